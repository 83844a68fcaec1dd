//! The admin page every node serves under `/admin/` on the API's port: the page itself
//! (the files of `web/`, embedded in the binary, so there is nothing to install) and
//! its JSON API under `/admin/api/`, behind a login.
//!
//! The login: on a cluster without an admin password the page asks for one (kept in
//! the cluster state as an Argon2id hash, so the same password works on every node);
//! then every admin route needs a session cookie (HttpOnly, SameSite=Strict, signed
//! with the cluster's session key, expiring), every change also the session's CSRF
//! token in a header, and wrong passwords are limited per address. See [`auth`].
//!
//! The first password is set from a browser on the node's own machine; on a hub
//! appliance (no screen), also from another machine of its LAN that reaches it by
//! address or as `shoal.local`, with the box's first-boot settings. A hub appliance's
//! page also manages its system (time zone, WiFi, updates, reboot, factory reset)
//! through files shared with the image's scripts: see [`appliance`].
//!
//! It runs over an [`AdminBackend`] the node provides: this crate holds no cluster code
//! and never links llama.cpp, so its routes are tested against a fake backend.
//!
//! Invariants: no admin route but the page's files, `session`, `setup` and `login`
//! answers without a valid session; a request never panics the server; the page
//! loads nothing from another host (its Content-Security-Policy says so too).

// The handlers' helpers return the answer to send as their error: built once per
// request on its way out, so its size costs nothing worth a box.
#![allow(clippy::result_large_err)]

pub mod appliance;
pub mod auth;
pub mod overview;

pub use appliance::Appliance;
pub use auth::{AuthRecord, AUTH_KEY};
pub use overview::{
    Activity, Download, Gpu, Hop, KeyRow, LogEvent, Machine, ModelCard, NodeCard, Overview, PendingNode, Settings,
    StageCard,
};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Extension, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Password hashes (login, setup, change) running at once.
const HASHING: usize = 2;
/// Largest JSON body the admin routes take (uploads aside).
const MAX_JSON: usize = 64 << 10;
/// Longest wait for the next bytes of an upload.
const UPLOAD_IDLE: Duration = Duration::from_secs(60);

/// The session cookie's name.
pub const COOKIE: &str = "shoal_session";
/// The header that carries the CSRF token.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// What the admin page needs from the node.
pub trait AdminBackend: Send + Sync + 'static {
    /// This node's cluster (its id, hex), `None` while it is in none; and the admin
    /// credentials the cluster state holds, `None` before the first password.
    fn credentials(&self) -> (Option<String>, Option<AuthRecord>);

    /// This node's own secret, which signs its admin sessions with the record's key
    /// (derived from the node's private key: no other member can compute it; see
    /// [`auth`]).
    fn session_secret(&self) -> [u8; 32];

    /// Store `record` as the cluster's admin credentials, replacing any; resolve once
    /// this node's own view of the cluster state holds them (so the session issued
    /// next is honoured here at once).
    fn set_credentials(&self, record: AuthRecord) -> impl Future<Output = Result<(), String>> + Send;

    /// The pool as this node sees it now.
    fn overview(&self) -> impl Future<Output = Overview> + Send;

    /// Do what the owner asked on the page; the answer's JSON, or why not.
    fn act(&self, action: Action) -> impl Future<Output = Result<serde_json::Value, ActionError>> + Send;

    /// Where files uploaded from the page are written (then added to the catalog).
    fn upload_dir(&self) -> std::path::PathBuf;

    /// The hub appliance's folder when this node is one (`shoal serve --appliance`: its
    /// system settings, updates and resets are managed from the page); `None` on any
    /// other node. The `appliance_*` actions go to [`appliance::act`].
    fn appliance(&self) -> Option<&Appliance>;
}

/// What the owner can do from the page (`POST /admin/api/action`, JSON with an
/// `action` field naming the variant in snake case).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Let in a pending node (its id or a unique prefix) whose owner agreed to join.
    Approve {
        /// Id or prefix.
        node: String,
    },
    /// Remove a member and revoke its key.
    Remove {
        /// Id or prefix.
        node: String,
    },
    /// A pairing code (valid minutes) for a new node's owner to type.
    PairingCode,
    /// A join token (one use, valid `valid_s` seconds) for a machine installed unattended.
    JoinToken {
        /// Validity, seconds (default: a day).
        #[serde(default = "a_day")]
        valid_s: u64,
    },
    /// Add the GGUF at `path` on this node to the catalog.
    ModelAdd {
        /// Absolute path on the node's machine.
        path: String,
        /// Catalog name (default: the file's).
        #[serde(default)]
        name: Option<String>,
    },
    /// Keep a model loaded: the leader places it.
    ModelLoad {
        /// Name or hash prefix.
        model: String,
        /// Positions per session (default: 4096 within the model's own).
        #[serde(default)]
        context: Option<u32>,
        /// Nodes (ids or prefixes) it must not use.
        #[serde(default)]
        exclude: Vec<String>,
    },
    /// Stop running a model.
    ModelUnload {
        /// Name or hash prefix.
        model: String,
    },
    /// Remove a model from the catalog (unloaded first).
    ModelRemove {
        /// Name or hash prefix.
        model: String,
    },
    /// Download a model (`https://…` or `hf://org/repo[@rev]/file.gguf`) into the
    /// node's models folder and add it; runs on, its progress in the overview.
    ModelDownload {
        /// URL or `hf://` name.
        source: String,
    },
    /// Add every model found in another program's store on the node's machine.
    ModelImport {
        /// "ollama", "lmstudio" or "hf" (the Hugging Face cache).
        from: String,
    },
    /// Make an API key; its secret is in the answer, once.
    KeyCreate {
        /// What it is for, e.g. open-webui.
        name: String,
        /// What it may do (a chat client's key by default).
        #[serde(default)]
        scope: shoal_types::KeyScope,
    },
    /// Revoke an API key: every node refuses it from then on.
    KeyRevoke {
        /// Its name.
        name: String,
    },
    /// What the planner would do with a model at another context, or without some
    /// members; nothing changes (a [`ModelCard`] in the answer).
    PlanPreview {
        /// Name or hash prefix.
        model: String,
        /// Positions per session.
        context: u32,
        /// Members (ids or prefixes) to leave out.
        #[serde(default)]
        exclude: Vec<String>,
    },
    /// Let every machine call the API without a key (`true`), or only with one.
    ApiOpen {
        /// Whether no key is needed.
        open: bool,
    },
    /// Whether stages spin between tokens: "on", "off", or "node" (each node's flag).
    /// Stages started from then on follow it.
    KeepAlive {
        /// "on", "off" or "node".
        mode: String,
    },
    /// Name the cluster (shown on every node's page).
    ClusterName {
        /// 1 to 64 characters.
        name: String,
    },
    /// Hub appliance: change the time zone and the WiFi network (each absent: kept;
    /// `null`: none), write them to `settings.json` and ask the system to apply them.
    ApplianceSettings {
        /// A time zone of the database (`Europe/Paris`), or `null`.
        #[serde(default, deserialize_with = "present", skip_serializing_if = "Option::is_none")]
        timezone: Option<Option<String>>,
        /// `{"ssid", "passphrase"}` (no passphrase: an open network), or `null`.
        #[serde(default, deserialize_with = "present", skip_serializing_if = "Option::is_none")]
        wifi: Option<Option<appliance::Wifi>>,
    },
    /// Hub appliance: install the uploaded update bundle, then reboot.
    ApplianceUpdate,
    /// Hub appliance: factory reset (every piece of data wiped, back to the first boot)
    /// and reboot.
    ApplianceReset,
    /// Hub appliance: reboot.
    ApplianceReboot,
}

fn a_day() -> u64 {
    86_400
}

/// A field that is there (`null` included): `Some(value)`; with `#[serde(default)]` an
/// absent one stays `None`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    <Option<T> as serde::Deserialize>::deserialize(d).map(Some)
}

/// A cluster name as it is kept: `name` trimmed, 1 to 64 characters, none of them
/// control characters; or why not.
pub fn cluster_name(name: &str) -> Result<String, String> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
        return Err("a cluster name has 1 to 64 characters, none of them control characters".into());
    }
    Ok(name.to_string())
}

/// Why an [`Action`] was not done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActionError {
    /// The HTTP status to answer with (400, 404, 409, 503…).
    pub status: u16,
    /// For people.
    pub message: String,
}

/// How the admin routes behave.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long a session lasts from login.
    pub session_ttl: Duration,
    /// Mark the cookie `Secure` (only when the page is served over TLS).
    pub secure_cookie: bool,
    /// How often the live overview is recomputed (sent only when it changed).
    pub refresh: Duration,
}

impl Default for Config {
    /// Twelve-hour sessions over plain HTTP; a refresh every second.
    fn default() -> Config {
        Config { session_ttl: Duration::from_secs(12 * 3600), secure_cookie: false, refresh: Duration::from_secs(1) }
    }
}

/// The admin routes' shared state.
struct Admin<B> {
    /// The node.
    backend: Arc<B>,
    /// Session length, cookie flags, refresh.
    cfg: Config,
    /// Wrong passwords by address (this node's; each node limits its own callers).
    attempts: Mutex<auth::Attempts>,
    /// Sessions logged out on this node, by nonce, with their expiry (dropped after
    /// it): a token is stateless, so logging out elsewhere ends it only there; a new
    /// password ends every session everywhere.
    revoked: Mutex<HashMap<String, u64>>,
    /// Password hashes running at once (each holds ~19 MiB for a few tens of ms): more
    /// are answered "busy" rather than queued.
    hashing: Arc<tokio::sync::Semaphore>,
    /// The last overview and when it was made: every open page shares it within a
    /// refresh period.
    last: tokio::sync::Mutex<Option<(std::time::Instant, Overview)>>,
    /// Held while a first password is being set: one at a time.
    setting_up: tokio::sync::Mutex<()>,
}

/// Every admin route over `backend`: the page under `/admin/`, its API under
/// `/admin/api/`. Merge it into the node's router.
///
/// `llm` (the node's OpenAI routes, without their key check) is served under
/// `/admin/api/llm/` to a logged-in page, which needs no API key for its chat.
pub fn router<B: AdminBackend>(backend: Arc<B>, cfg: Config, llm: Router) -> Router {
    let admin = Arc::new(Admin {
        backend,
        cfg,
        attempts: Mutex::new(auth::Attempts::default()),
        revoked: Mutex::new(HashMap::new()),
        hashing: Arc::new(tokio::sync::Semaphore::new(HASHING)),
        last: tokio::sync::Mutex::new(None),
        setting_up: tokio::sync::Mutex::new(()),
    });
    let guarded = || axum::middleware::from_fn_with_state(admin.clone(), guard::<B>);
    // Behind the login: nothing of a request is read before its session is checked.
    let inside = Router::new()
        .route("/admin/api/action", post(act::<B>))
        .route("/admin/api/logout", post(logout::<B>))
        .route("/admin/api/password", post(password::<B>))
        .route("/admin/api/overview", get(overview::<B>))
        .route("/admin/api/events", get(events::<B>))
        // A model is gigabytes: no body limit here, the body streams to disk.
        .route("/admin/api/upload", post(upload::<B>).layer(axum::extract::DefaultBodyLimit::disable()))
        .route("/admin/api/appliance", get(appliance_state::<B>))
        // A bundle is gigabytes: no body limit here either.
        .route("/admin/api/appliance/bundle", post(bundle::<B>).layer(axum::extract::DefaultBodyLimit::disable()))
        .route_layer(guarded());
    Router::new()
        .nest_service("/admin/api/llm", llm.layer(guarded()))
        .merge(inside)
        .route("/admin", get(|| async { Redirect::to("/admin/") }))
        .route("/admin/", get(|| async { asset("index.html") }))
        .route("/admin/{file}", get(|Path(file): Path<String>| async move { asset(&file) }))
        .route("/admin/api/session", get(session::<B>))
        .route("/admin/api/setup", post(setup::<B>))
        .route("/admin/api/login", post(login::<B>))
        .route(
            "/admin/api/{*rest}",
            axum::routing::any(|| async { error(StatusCode::NOT_FOUND, "no such admin route") }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(admin)
}

/// The page's files, embedded at build time.
const ASSETS: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", include_str!("../../../web/index.html")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("../../../web/app.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("../../../web/style.css")),
    ("icon.svg", "image/svg+xml", include_str!("../../../web/icon.svg")),
    // uPlot (MIT), from the npm cache when the build found it (build.rs).
    ("uplot.js", "text/javascript; charset=utf-8", include_str!(concat!(env!("OUT_DIR"), "/uplot.js"))),
    ("uplot.css", "text/css; charset=utf-8", include_str!(concat!(env!("OUT_DIR"), "/uplot.css"))),
];

/// One of the page's files, or 404.
fn asset(name: &str) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, kind, body)) => {
            ([(header::CONTENT_TYPE, *kind), (header::CACHE_CONTROL, "no-cache")], *body).into_response()
        }
        None => error(StatusCode::NOT_FOUND, "no such file"),
    }
}

/// Headers every admin answer carries: the page may load only from this node, may not
/// be framed (clickjacking), and answers are not sniffed as another type.
async fn security_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
             frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// `GET /admin/api/session`: what the page should show: `unpaired` (this node is in no
/// cluster yet), `setup` (no password yet), `login`, or `in` with the CSRF token.
async fn session<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    let (cluster, record) = admin.backend.credentials();
    let Some(cluster) = cluster else { return no_store(Json(json!({"state": "unpaired"}))) };
    let Some(record) = record else {
        let appliance = admin.backend.appliance();
        let here = may_set_up(appliance, peer, &headers);
        let why = if appliance.is_some() { SETUP_APPLIANCE } else { SETUP_HERE };
        return no_store(Json(json!({
            "state": "setup",
            "cluster": cluster,
            "here": here,
            "why": why,
            "appliance": appliance.is_some(),
            // The box's setup code is asked for (see `setup`).
            "code": appliance.is_some() && !this_machine(peer, &headers),
        })));
    };
    match admin.session(&cluster, &record, &headers) {
        Ok((token, s)) => no_store(Json(json!({
            "state": "in",
            "cluster": cluster,
            "csrf": record.csrf(&admin.backend.session_secret(), &cluster, &token),
            "expires": s.expires,
        }))),
        Err(_) => no_store(Json(json!({"state": "login", "cluster": cluster}))),
    }
}

/// Where the first password may be set from.
const SETUP_HERE: &str = "set the first admin password from a browser on one of the cluster's machines \
     (http://localhost:11434/admin/), or with `shoal password` on one of them";

/// Where a hub appliance's first password may be set from.
const SETUP_APPLIANCE: &str = "set up this hub box from a browser on its network, at \
     http://shoal.local:11434/admin/ or at the box's IP address (not through another name), \
     with the setup code it shows, or with `shoal password` on the box";

/// Why a machine of the LAN cannot set a hub appliance up without its code.
const SETUP_CODE: &str = "give the box's setup code: it is shown on a screen plugged into the box \
     (at its login prompt) and in SHOAL-SETUP.TXT on its boot partition";

/// Whether a request comes from a program on this machine, addressed to this machine
/// (loopback, and a `Host` and `Origin` that name it: not a DNS-rebinding page).
fn this_machine(peer: SocketAddr, headers: &HeaderMap) -> bool {
    shoal_api::is_loopback(peer.ip()) && shoal_api::local_caller(headers, &[])
}

/// Whether a request may set the first admin password: one from this machine
/// ([`this_machine`]) always; on a hub appliance (`appliance`), which has no screen,
/// also one from another machine of its network that reaches it by a name of its own
/// ([`from_lan`]).
fn may_set_up(appliance: Option<&Appliance>, peer: SocketAddr, headers: &HeaderMap) -> bool {
    this_machine(peer, headers) || appliance.is_some_and(|a| from_lan(a.host_name(), peer.ip(), headers))
}

/// Whether a request comes from a machine of the LAN (`peer` is not a public IPv4
/// address: that would be a port forwarded from the Internet) to this box as browsers
/// there reach it: a `Host` (any port) that is an IP address (`192.168.1.20`,
/// `[fd00::2]`), `shoal.local` (or `shoal-N.local`, mDNS's name for it when another hub
/// holds `shoal.local`) or `<host>.local` (`host`: this machine's name), case-insensitive;
/// and an `Origin`, when there is one, of the same host and port. A DNS-rebinding page
/// has a name of its own in `Host`, another site's page its own `Origin`: both are
/// refused.
fn from_lan(host: Option<&str>, peer: std::net::IpAddr, headers: &HeaderMap) -> bool {
    if !lan_peer(peer) {
        return false;
    }
    let Some(authority) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else { return false };
    let Some((name, _)) = host_and_port(authority) else { return false };
    let name = name.to_ascii_lowercase();
    let numbered = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    let names_box = name.parse::<std::net::IpAddr>().is_ok()
        || name.strip_suffix(".local").is_some_and(|label| {
            label == "shoal" || label.strip_prefix("shoal-").is_some_and(numbered) || host.is_some_and(|h| h == label)
        });
    let origin_ok = headers.get(header::ORIGIN).is_none_or(|o| {
        o.to_str().is_ok_and(|o| {
            o.split_once("://").is_some_and(|(scheme, rest)| {
                matches!(scheme, "http" | "https") && rest.eq_ignore_ascii_case(authority)
            })
        })
    });
    names_box && origin_ok
}

/// `host[:port]` split into the host (an IPv6 address without its brackets) and the
/// port, if any; `None` when it is not of that form.
fn host_and_port(authority: &str) -> Option<(&str, Option<u16>)> {
    let port = |p: &str| -> Option<u16> {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        p.parse().ok()
    };
    if let Some(rest) = authority.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        v6.parse::<std::net::Ipv6Addr>().ok()?;
        return match after {
            "" => Some((v6, None)),
            _ => Some((v6, Some(port(after.strip_prefix(':')?)?))),
        };
    }
    let (h, p) = match authority.split_once(':') {
        Some((h, p)) => (h, Some(port(p)?)),
        None => (authority, None),
    };
    let ok = !h.is_empty() && h.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'));
    ok.then_some((h, p))
}

/// Whether `ip` may be a machine of the LAN: any IPv6 address (home routers let no
/// connection in unasked, and LANs use global ones), an IPv4 one that is loopback,
/// private, link-local or shared (100.64/10); never a public IPv4 address.
fn lan_peer(ip: std::net::IpAddr) -> bool {
    let v4 = match ip {
        std::net::IpAddr::V4(v4) => v4,
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4,
            None => return true,
        },
    };
    let [a, b, ..] = v4.octets();
    let shared = a == 100 && (b & 0xc0) == 64;
    v4.is_loopback() || v4.is_private() || v4.is_link_local() || shared
}

/// The body of `login`.
#[derive(serde::Deserialize)]
struct PasswordBody {
    password: String,
}

/// The body of `setup`: the password; on a hub appliance, optionally the cluster's
/// name, the time zone and the WiFi network too.
#[derive(serde::Deserialize)]
struct SetupBody {
    password: String,
    #[serde(default)]
    cluster_name: Option<String>,
    #[serde(default)]
    timezone: Option<String>,
    #[serde(default)]
    wifi: Option<appliance::Wifi>,
    /// A hub appliance's setup code, which a machine of its LAN must give
    /// ([`appliance::Appliance::setup_code`]).
    #[serde(default)]
    code: Option<String>,
}

/// `POST /admin/api/setup {"password", "cluster_name"?, "timezone"?, "wifi"?}`: the first
/// password of a cluster that has none; logs the caller in. The other fields are a hub
/// appliance's first-boot settings: every field is checked before anything is stored;
/// then the password is stored, and the name and the system settings after it (what of
/// those fails is said in `warnings`: the password stays set).
async fn setup<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = same_origin_json(&headers) {
        return r;
    }
    // Until the first password, whoever sets it owns the cluster: only a browser on
    // this machine may (or its owner, with `shoal password`), never another machine of
    // the LAN, nor a page that reaches this port through a name of its own. A hub
    // appliance has no screen: there a browser of its LAN may too (`from_lan`).
    let appliance = admin.backend.appliance();
    if !may_set_up(appliance, peer, &headers) {
        return error(StatusCode::FORBIDDEN, if appliance.is_some() { SETUP_APPLIANCE } else { SETUP_HERE });
    }
    let body: SetupBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    // Another machine of a hub's LAN proves it has the box in hand: the code the box
    // shows (security review F10). Wrong codes count as wrong passwords.
    if let Some(a) = appliance.filter(|_| !this_machine(peer, &headers)) {
        let Some(want) = a.setup_code() else {
            return error(
                StatusCode::FORBIDDEN,
                "this box has no setup code yet: restart it, or use `shoal password` on it",
            );
        };
        let given = appliance::code_digits(body.code.as_deref().unwrap_or(""));
        if given.is_empty() {
            return error(StatusCode::FORBIDDEN, SETUP_CODE);
        }
        match admin.check_password(peer.ip(), move || auth::constant_eq(given.as_bytes(), want.as_bytes())).await {
            Ok(true) => {}
            Ok(false) => return error(StatusCode::FORBIDDEN, &format!("the setup code is wrong: {SETUP_CODE}")),
            Err(r) => return r,
        }
    }
    let (cluster, record) = admin.backend.credentials();
    let Some(cluster) = cluster else {
        return error(StatusCode::CONFLICT, "this node is in no cluster yet: it forms or joins one first");
    };
    if record.is_some() {
        return error(StatusCode::CONFLICT, "the admin password is set: log in with it");
    }
    // Everything is checked before anything is stored.
    if let Err(e) = auth::check_length(&body.password) {
        return error(StatusCode::BAD_REQUEST, &e.to_string());
    }
    let name = match body.cluster_name.as_deref().map(cluster_name).transpose() {
        Ok(n) => n,
        Err(why) => return error(StatusCode::BAD_REQUEST, &why),
    };
    let system = match (body.timezone.is_some() || body.wifi.is_some(), appliance) {
        (false, _) => None,
        (true, None) => {
            return error(StatusCode::BAD_REQUEST, "the time zone and WiFi are set here only on a hub appliance");
        }
        (true, Some(a)) => {
            let change = appliance::Change { timezone: body.timezone.map(Some), wifi: body.wifi.map(Some) };
            let (a, checked) = (a.clone(), change.clone());
            match tokio::task::spawn_blocking(move || a.validate(&a.changed(&checked))).await {
                Ok(Ok(())) => Some(change),
                Ok(Err(e)) => {
                    return error(StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST), &e.to_string())
                }
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            }
        }
    };
    // One setup at a time (the next one sees the password the first set), and its hash
    // within the bound on hashes at once: on a hub, the whole LAN may ask.
    let busy = |what: &str| {
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, &format!("{what}: try again in a moment"));
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
        r
    };
    let Ok(_one) = admin.setting_up.try_lock() else { return busy("a first password is being set") };
    if admin.backend.credentials().1.is_some() {
        return error(StatusCode::CONFLICT, "the admin password is set: log in with it");
    }
    let Ok(permit) = admin.hashing.clone().try_acquire_owned() else { return busy("busy checking other passwords") };
    let now = unix_now();
    let made = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        AuthRecord::new(&body.password, now)
    })
    .await;
    let record = match made {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    if let Err(e) = admin.backend.set_credentials(record.clone()).await {
        return error(StatusCode::SERVICE_UNAVAILABLE, &format!("the password was not stored: {e}"));
    }
    tracing::info!(%peer, "admin password set");
    let mut warnings = Vec::new();
    if let Some(name) = name {
        if let Err(e) = admin.backend.act(Action::ClusterName { name }).await {
            warnings.push(format!("the cluster's name was not set: {}", e.message));
        }
    }
    if let Some(change) = system {
        let settings = Action::ApplianceSettings { timezone: change.timezone, wifi: change.wifi };
        if let Err(e) = admin.backend.act(settings).await {
            warnings.push(format!("the system settings were not applied: {}", e.message));
        }
    }
    admin.start_session(&cluster, &record, warnings)
}

/// `POST /admin/api/login {"password"}`.
async fn login<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = same_origin_json(&headers) {
        return r;
    }
    let body: PasswordBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let (Some(cluster), Some(record)) = admin.backend.credentials() else {
        return error(StatusCode::CONFLICT, "no admin password is set yet: set one first");
    };
    let check = record.clone();
    match admin.check_password(peer.ip(), move || check.verify(&body.password)).await {
        Ok(true) => admin.start_session(&cluster, &record, Vec::new()),
        Ok(false) => {
            tracing::warn!(%peer, "admin login: wrong password");
            error(StatusCode::UNAUTHORIZED, "wrong password")
        }
        Err(r) => r,
    }
}

/// The body of `password`.
#[derive(serde::Deserialize)]
struct NewPassword {
    current: String,
    new: String,
}

/// `POST /admin/api/password {"current", "new"}`: a new admin password (the current one
/// checked, within the same limit on wrong ones as login). Every session on every node
/// ends, but the caller's, which gets a new one.
async fn password<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Extension(Authorized { cluster, record, .. }): Extension<Authorized>,
    body: Bytes,
) -> Response {
    let body: NewPassword = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if let Err(e) = auth::check_length(&body.new) {
        return error(StatusCode::BAD_REQUEST, &e.to_string());
    }
    let now = unix_now();
    let (current, new) = (body.current, body.new);
    // The new record is made in the same blocking task as the check (two hashes).
    let made = Arc::new(Mutex::new(None));
    let out = made.clone();
    let checked = admin
        .check_password(peer.ip(), move || {
            if !record.verify(&current) {
                return false;
            }
            *lock(&out) = Some(AuthRecord::new(&new, now));
            true
        })
        .await;
    let made = lock(&made).take();
    let record = match (checked, made) {
        (Ok(true), Some(Ok(r))) => r,
        (Ok(true), Some(Err(e))) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        (Ok(_), _) => return error(StatusCode::UNAUTHORIZED, "the current password is wrong"),
        (Err(r), _) => return r,
    };
    if let Err(e) = admin.backend.set_credentials(record.clone()).await {
        return error(StatusCode::SERVICE_UNAVAILABLE, &format!("the password was not stored: {e}"));
    }
    tracing::info!("admin password changed from the page");
    admin.start_session(&cluster, &record, Vec::new())
}

/// `POST /admin/api/logout`: ends the session on this node and clears the cookie.
async fn logout<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    Extension(Authorized { session: s, .. }): Extension<Authorized>,
) -> Response {
    {
        let mut revoked = lock(&admin.revoked);
        let now = unix_now();
        revoked.retain(|_, expires| *expires > now);
        revoked.insert(s.nonce, s.expires);
    }
    let mut r = no_store(Json(json!({"state": "login"})));
    r.headers_mut().insert(header::SET_COOKIE, admin.cookie("", 0));
    r
}

/// Let a request through to the routes behind the login only with a session (and, for
/// a change, its CSRF token).
async fn guard<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match admin.authorize(req.method(), req.headers()) {
        Ok(proved) => {
            req.extensions_mut().insert(proved);
            next.run(req).await
        }
        Err(r) => r,
    }
}

/// What [`guard`] proved of a request behind the login, handed to its handler.
#[derive(Clone)]
struct Authorized {
    /// The cluster the session belongs to.
    cluster: String,
    /// The credentials it was checked against.
    record: AuthRecord,
    /// The session.
    session: auth::Session,
}

/// `POST /admin/api/action {"action": …}`: see [`Action`].
async fn act<B: AdminBackend>(State(admin): State<Arc<Admin<B>>>, body: Bytes) -> Response {
    let action: Action = match parse(&body) {
        Ok(a) => a,
        Err(r) => return r,
    };
    tracing::info!(?action, "admin page action");
    match admin.backend.act(action).await {
        Ok(v) => no_store(Json(v)),
        Err(e) => error(StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST), &e.message),
    }
}

/// The query of an upload.
#[derive(serde::Deserialize)]
struct UploadQuery {
    /// The file's name (its last path component is used; it must end in `.gguf`).
    name: String,
}

/// `POST /admin/api/upload?name=FILE.gguf` with the file as the body: streamed to
/// `<upload dir>/FILE.gguf` ([`receive`]; the name must still be free when it arrives),
/// then checked and added to the catalog as [`Action::ModelAdd`] does. A file that is
/// not a usable model is deleted and refused with the reason; an upload cut short
/// leaves nothing behind.
async fn upload<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    axum::extract::Query(q): axum::extract::Query<UploadQuery>,
    body: axum::body::Body,
) -> Response {
    let Some(name) = upload_name(&q.name) else {
        return error(
            StatusCode::BAD_REQUEST,
            "name the file NAME.gguf (letters, digits, '.', '-', '_', at most 200 characters)",
        );
    };
    let dest = admin.backend.upload_dir().join(&name);
    if dest.exists() {
        return error(StatusCode::CONFLICT, &format!("{} exists on this node: rename the file", dest.display()));
    }
    let received = match receive(body, &dest, Land::Fresh, u64::MAX).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    tracing::info!(file = %dest.display(), bytes = received, "model uploaded from the admin page");
    match admin.backend.act(Action::ModelAdd { path: dest.display().to_string(), name: None }).await {
        Ok(v) => no_store(Json(json!({"added": v.get("added").cloned().unwrap_or(json!(name)), "bytes": received}))),
        // Not a model the cluster can use: nothing of it stays.
        Err(e) if e.status == 400 => {
            let _ = tokio::fs::remove_file(&dest).await;
            error(StatusCode::BAD_REQUEST, &e.message)
        }
        // Anything else (the catalog unavailable for a moment): the file stays, whole.
        Err(e) => error(
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            &format!("{} (the file is kept at {}: add it by path later)", e.message, dest.display()),
        ),
    }
}

/// How a received file takes its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Land {
    /// Only if the name is still free (a file that appeared meanwhile stays): 409.
    Fresh,
    /// In place of any file of that name, at once (a reader of the old one keeps it).
    Replace,
}

/// Stream `body` to `dest`: first to a staging file of its own beside it,
/// `.upload-<nonce>-<name>.part` (one network chunk in memory at a time, whatever the
/// size), fsynced, then named `dest` as `land` says. At most `max` bytes (413 past it);
/// a client silent for [`UPLOAD_IDLE`] is cut off (408). However it ends (a dropped
/// request too), the staging file is gone. The bytes received, or the answer that says
/// why not.
async fn receive(body: axum::body::Body, dest: &std::path::Path, land: Land, max: u64) -> Result<u64, Response> {
    use futures_util::StreamExt;
    use tokio::io::AsyncWriteExt;
    let io = |what: &str, e: std::io::Error| error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{what}: {e}"));
    let (Some(dir), Some(name)) = (dest.parent(), dest.file_name().and_then(|n| n.to_str())) else {
        return Err(error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{}: not a file's path", dest.display())));
    };
    if let Err(e) = tokio::fs::create_dir_all(dir).await {
        return Err(io(&dir.display().to_string(), e));
    }
    // A staging name of its own (downloads resume from `NAME.part`: the two must never
    // share a file), removed by the guard however this ends, a dropped request too.
    let mut nonce = [0u8; 8];
    if let Err(e) = getrandom::getrandom(&mut nonce) {
        return Err(error(StatusCode::INTERNAL_SERVER_ERROR, &format!("no randomness: {e}")));
    }
    let staging = Staging(dir.join(format!(".upload-{}-{name}.part", hex::encode(nonce))));
    let mut file = match tokio::fs::OpenOptions::new().write(true).create_new(true).open(&staging.0).await {
        Ok(f) => f,
        Err(e) => return Err(io(&staging.0.display().to_string(), e)),
    };
    let mut stream = body.into_data_stream();
    let mut received: u64 = 0;
    let part = staging.0.display().to_string();
    let written = async {
        loop {
            // A client that stops sending without closing does not hold the upload.
            let next = tokio::time::timeout(UPLOAD_IDLE, stream.next())
                .await
                .map_err(|_| (StatusCode::REQUEST_TIMEOUT, format!("no bytes for {} s", UPLOAD_IDLE.as_secs())))?;
            let Some(chunk) = next else { break };
            let chunk = chunk.map_err(|e| (StatusCode::BAD_REQUEST, format!("the upload broke off: {e}")))?;
            received += chunk.len() as u64;
            if received > max {
                return Err((StatusCode::PAYLOAD_TOO_LARGE, format!("over the limit of {max} bytes")));
            }
            file.write_all(&chunk).await.map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, format!("{part}: {e}")))?;
        }
        file.sync_all().await.map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, format!("{part}: {e}")))?;
        drop(file);
        let named = match land {
            // A link fails where the name exists (a file that appeared meanwhile stays).
            Land::Fresh => tokio::fs::hard_link(&staging.0, dest).await,
            Land::Replace => tokio::fs::rename(&staging.0, dest).await,
        };
        match named {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err((StatusCode::CONFLICT, format!("{} appeared meanwhile: rename the file", dest.display())))
            }
            Err(e) => Err((StatusCode::INTERNAL_SERVER_ERROR, format!("{}: {e}", dest.display()))),
        }
    };
    let result = written.await;
    drop(staging);
    match result {
        Ok(()) => Ok(received),
        Err((status, why)) => Err(error(status, &why)),
    }
}

/// `GET /admin/api/appliance`: whether this node is a hub appliance, its system settings
/// as the page may see them (`{"timezone", "wifi": {"ssid"}}`, never the passphrase)
/// and what its system side reports (`status.json` as read, or `null` when it says
/// nothing readable).
async fn appliance_state<B: AdminBackend>(State(admin): State<Arc<Admin<B>>>) -> Response {
    let Some(a) = admin.backend.appliance().cloned() else {
        return no_store(Json(json!({"appliance": false, "settings": null, "status": null})));
    };
    match tokio::task::spawn_blocking(move || (a.settings(), a.status())).await {
        Ok((settings, status)) => {
            no_store(Json(json!({"appliance": true, "settings": settings.public(), "status": status})))
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// `POST /admin/api/appliance/bundle` with an update bundle as the body: streamed to
/// the appliance folder's `update.raucb` ([`receive`], in place of any earlier one), at
/// most [`appliance::MAX_BUNDLE_BYTES`]. Installing it is the `appliance_update` action.
async fn bundle<B: AdminBackend>(
    State(admin): State<Arc<Admin<B>>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let Some(a) = admin.backend.appliance() else {
        return error(StatusCode::CONFLICT, appliance::NOT_AN_APPLIANCE);
    };
    let max = appliance::MAX_BUNDLE_BYTES;
    let announced = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max) {
        return error(StatusCode::PAYLOAD_TOO_LARGE, &format!("an update bundle has at most {} GiB", max >> 30));
    }
    let dest = a.bundle_path();
    match receive(body, &dest, Land::Replace, max).await {
        Ok(bytes) => {
            tracing::info!(bytes, "update bundle uploaded from the admin page");
            no_store(Json(json!({"bytes": bytes})))
        }
        Err(r) => r,
    }
}

/// An upload's staging file, deleted when dropped (after the link to its name, or on
/// any failure, or when the request is dropped part way).
struct Staging(std::path::PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The file name an upload may take: the last component of `name`, a `.gguf` of safe
/// characters (no separators, no leading dot).
fn upload_name(name: &str) -> Option<String> {
    let base = name.rsplit(['/', '\\']).next()?;
    let ok = base.len() <= 200
        && base.len() > ".gguf".len()
        && base.to_ascii_lowercase().ends_with(".gguf")
        && !base.starts_with('.')
        && base.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    ok.then(|| base.to_string())
}

/// `GET /admin/api/overview`: the pool now.
async fn overview<B: AdminBackend>(State(admin): State<Arc<Admin<B>>>) -> Response {
    no_store(Json(admin.cached_overview().await))
}

/// `GET /admin/api/events`: the overview as server-sent events (`overview`), sent when
/// it changes; the stream ends when the session does (expiry, or a new password).
async fn events<B: AdminBackend>(State(admin): State<Arc<Admin<B>>>, headers: HeaderMap) -> Response {
    let stream = futures_util::stream::unfold((admin, headers, None::<String>), |(admin, headers, last)| async move {
        loop {
            // The first overview goes at once; later ones when they differ.
            if last.is_some() {
                tokio::time::sleep(admin.cfg.refresh).await;
            }
            // The guard checked the session at the start; it may end meanwhile.
            if admin.authorize(&Method::GET, &headers).is_err() {
                return None;
            }
            let overview = admin.cached_overview().await;
            // The time the counters were read always moves: it alone is no change.
            let mut same = overview.clone();
            same.activity.at_ms = 0;
            let key = serde_json::to_string(&same).unwrap_or_default();
            if last.as_deref() != Some(key.as_str()) {
                let event =
                    Event::default().event("overview").data(serde_json::to_string(&overview).unwrap_or_default());
                return Some((Ok::<_, std::convert::Infallible>(event), (admin, headers, Some(key))));
            }
        }
    });
    let mut r = Sse::new(stream).keep_alive(KeepAlive::default()).into_response();
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

impl<B: AdminBackend> Admin<B> {
    /// The session the request's cookie proves, with its token; and, for anything but
    /// GET and HEAD, its CSRF token in [`CSRF_HEADER`]. Else the answer to send: 401
    /// (no session, not valid here, or no password set yet), 403 (no or a wrong CSRF
    /// token).
    fn authorize(&self, method: &Method, headers: &HeaderMap) -> Result<Authorized, Response> {
        let (Some(cluster), Some(record)) = self.backend.credentials() else {
            return Err(error(StatusCode::UNAUTHORIZED, "no admin password is set yet: set one first"));
        };
        let (token, s) = self
            .session(&cluster, &record, headers)
            .map_err(|why| error(StatusCode::UNAUTHORIZED, &format!("log in first ({why})")))?;
        if method != Method::GET && method != Method::HEAD {
            let presented = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
            if !record.csrf_matches(&self.backend.session_secret(), &cluster, &token, presented) {
                return Err(error(StatusCode::FORBIDDEN, "missing or wrong CSRF token: reload the page"));
            }
        }
        Ok(Authorized { cluster, record, session: s })
    }

    /// Run `check` (a password hash: slow, memory-hungry) for a caller at `ip`, within
    /// the limit on wrong passwords (the attempt counts as wrong until it proves right)
    /// and on hashes at once. `Err`: the answer that refuses it unchecked.
    async fn check_password(
        &self,
        ip: std::net::IpAddr,
        check: impl FnOnce() -> bool + Send + 'static,
    ) -> Result<bool, Response> {
        let Ok(permit) = self.hashing.clone().try_acquire_owned() else {
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "busy checking other passwords: try again in a moment");
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
            return Err(r);
        };
        let at = unix_now();
        if let Err(wait) = lock(&self.attempts).begin(ip, at) {
            let mut r = error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!("too many wrong passwords from this address: try again in {wait} s"),
            );
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(wait));
            return Err(r);
        }
        // The hash runs to its end even if the caller goes away; it holds the permit
        // until then, so the bound holds.
        let right = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            check()
        })
        .await
        .unwrap_or(false);
        if right {
            lock(&self.attempts).right(ip, at);
        }
        Ok(right)
    }

    /// The overview, made at most once per refresh period for every open page.
    async fn cached_overview(&self) -> Overview {
        let mut last = self.last.lock().await;
        if let Some((at, o)) = last.as_ref() {
            if at.elapsed() < self.cfg.refresh / 2 {
                return o.clone();
            }
        }
        let o = self.backend.overview().await;
        *last = Some((std::time::Instant::now(), o.clone()));
        o
    }

    /// The session token in `headers`' cookie and the session it proves.
    fn session(
        &self,
        cluster: &str,
        record: &AuthRecord,
        headers: &HeaderMap,
    ) -> Result<(String, auth::Session), String> {
        let token = cookie(headers).ok_or_else(|| "no session".to_string())?;
        let node = self.backend.session_secret();
        let s = record.check(&node, cluster, &token, unix_now()).map_err(|e| e.to_string())?;
        if lock(&self.revoked).contains_key(&s.nonce) {
            return Err("the session was logged out".into());
        }
        Ok((token, s))
    }

    /// A new session: its cookie, and its CSRF token in the answer (with `warnings`,
    /// when there are some: what was asked beside it and not done).
    fn start_session(&self, cluster: &str, record: &AuthRecord, warnings: Vec<String>) -> Response {
        let ttl = self.cfg.session_ttl.as_secs().max(1);
        let node = self.backend.session_secret();
        let token = match record.issue(&node, cluster, unix_now(), ttl) {
            Ok(t) => t,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        };
        let mut body = json!({"state": "in", "cluster": cluster, "csrf": record.csrf(&node, cluster, &token)});
        if !warnings.is_empty() {
            body["warnings"] = json!(warnings);
        }
        let mut r = no_store(Json(body));
        r.headers_mut().insert(header::SET_COOKIE, self.cookie(&token, ttl));
        r
    }

    /// The `Set-Cookie` value for `token` lasting `max_age` seconds (0: delete it).
    fn cookie(&self, token: &str, max_age: u64) -> HeaderValue {
        let secure = if self.cfg.secure_cookie { "; Secure" } else { "" };
        let value = format!("{COOKIE}={token}; Path=/admin; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}");
        // Invariant: tokens are ASCII letters, digits and dots.
        HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("shoal_session=; Max-Age=0"))
    }
}

/// The session token in the request's cookies.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_string())
}

/// Refuse a login or setup that a page of another site could have sent: the body must
/// be JSON (a cross-site form cannot send that type without the browser asking first,
/// which this server never allows), and an `Origin`, when sent, must be this host.
fn same_origin_json(headers: &HeaderMap) -> Result<(), Response> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "send JSON (Content-Type: application/json)"));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
        let same = origin.to_str().is_ok_and(|o| {
            // (Host names are case-insensitive.)
            o.split_once("://")
                .is_some_and(|(scheme, rest)| matches!(scheme, "http" | "https") && rest.eq_ignore_ascii_case(host))
        });
        if !same {
            return Err(error(StatusCode::FORBIDDEN, "a request from another site's page"));
        }
    }
    Ok(())
}

/// Parse a JSON body, or the 400 that says why not.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| error(StatusCode::BAD_REQUEST, &format!("bad JSON: {e}")))
}

/// An error answer: `{"error": message}`.
fn error(status: StatusCode, message: &str) -> Response {
    (status, no_store(Json(json!({"error": message})))).into_response()
}

/// An answer no cache keeps (it carries session state).
fn no_store(body: impl IntoResponse) -> Response {
    let mut r = body.into_response();
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section is a single map or queue operation: a panic leaves it whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_hub_is_set_up_from_the_lan_only_through_its_own_names() {
        let lan: std::net::IpAddr = "192.168.1.30".parse().unwrap();
        let host = Some("hubbox");
        for ok in [
            vec![("host", "192.168.1.20:11434")],
            vec![("host", "192.168.1.20")],
            vec![("host", "[fd00::2]:11434"), ("origin", "http://[fd00::2]:11434")],
            vec![("host", "[fe80::1]")],
            vec![("host", "shoal.local:11434"), ("origin", "http://shoal.local:11434")],
            vec![("host", "SHOAL.local"), ("origin", "http://shoal.local")],
            vec![("host", "shoal-2.local:80")],
            vec![("host", "hubbox.local:8080"), ("origin", "https://hubbox.local:8080")],
        ] {
            assert!(from_lan(host, lan, &headers(&ok)), "{ok:?}");
        }
        for bad in [
            vec![],
            vec![("host", "evil.example")],
            vec![("host", "shoal.local.evil.example")],
            vec![("host", "192.168.1.20.nip.io")],
            vec![("host", "shoal.local:11434"), ("origin", "http://evil.example")],
            vec![("host", "shoal.local:11434"), ("origin", "http://shoal.local:8080")],
            vec![("host", "192.168.1.20:11434"), ("origin", "http://192.168.1.21:11434")],
            vec![("host", "shoal.local"), ("origin", "null")],
            vec![("host", "shoal.local"), ("origin", "file://shoal.local")],
            vec![("host", "other.local")],
            vec![("host", "shoal-x.local")],
            vec![("host", "shoal-.local")],
            vec![("host", "shoal.local:99999")],
            vec![("host", "shoal.local:")],
            vec![("host", "[fe80::1%25eth0]")],
            vec![("host", "[not-v6]:1")],
            vec![("host", "a:b:c")],
        ] {
            assert!(!from_lan(host, lan, &headers(&bad)), "{bad:?}");
        }
        assert!(!from_lan(None, lan, &headers(&[("host", "hubbox.local")])), "no host name known");
        // A public IPv4 peer is a port forwarded from the Internet.
        let ok = headers(&[("host", "shoal.local:11434")]);
        for peer in ["127.0.0.1", "10.1.2.3", "172.16.0.9", "169.254.3.4", "100.64.0.7", "fd00::9", "2a01:e0a::5"] {
            assert!(from_lan(host, peer.parse().unwrap(), &ok), "{peer}");
        }
        for peer in ["8.8.8.8", "100.128.0.1", "::ffff:8.8.8.8"] {
            assert!(!from_lan(host, peer.parse().unwrap(), &ok), "{peer}");
        }
    }

    #[test]
    fn appliance_actions_read_absent_and_null_apart() {
        let parse = |s: &str| serde_json::from_str::<Action>(s);
        assert_eq!(
            parse(r#"{"action":"appliance_settings","timezone":"UTC"}"#).unwrap(),
            Action::ApplianceSettings { timezone: Some(Some("UTC".into())), wifi: None }
        );
        assert_eq!(
            parse(r#"{"action":"appliance_settings","wifi":null}"#).unwrap(),
            Action::ApplianceSettings { timezone: None, wifi: Some(None) }
        );
        let Action::ApplianceSettings { wifi: Some(Some(w)), .. } =
            parse(r#"{"action":"appliance_settings","wifi":{"ssid":"home"}}"#).unwrap()
        else {
            panic!("a network")
        };
        assert_eq!((w.ssid.as_str(), w.passphrase.as_str()), ("home", ""));
        for bad in [
            r#"{"action":"appliance_settings","timezone":5}"#,
            r#"{"action":"appliance_settings","wifi":{"ssid":"a","psk":"b"}}"#,
            r#"{"action":"appliance_settings","other":1}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(parse(r#"{"action":"appliance_reboot"}"#).unwrap(), Action::ApplianceReboot);
    }
}
