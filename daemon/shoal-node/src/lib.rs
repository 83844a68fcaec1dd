//! The node process (`shoal serve`): one composition root for everything a machine
//! runs. It binds one pinned QUIC endpoint whose connections a router hands to each
//! service by ALPN (membership, admin, probes, the node protocol, and the pipeline
//! stages and shard transfers as they land), keeps the open join endpoint apart, and
//! serves the model catalog. The `shoal` binary is a thin CLI over it.
//!
//! Invariant: services share state only through membership (the replicated cluster
//! state, watched as a [`View`](shoal_membership::node::View)); nothing here holds a
//! second copy of who is a member.

pub mod admin;
pub mod api;
pub mod events;
pub mod http;
pub mod keys;
pub mod models;
pub mod notify;
pub mod runtime;
pub mod schedule;

use api::{ApiError, ErrorKind, NodeRequest, NodeResponse};
use runtime::{Engine, Runtime};
use shoal_gguf::ShardCache;
use shoal_membership::node::{self as membership, Handle, NodeConfig, SharedEndpoint};
use shoal_membership::wire::{read_msg, write_msg, AdminRequest, AdminResponse};
use shoal_net::{alpn, Identity, Incoming, NodeId};
use shoal_types::NodeInventory;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use tokio::sync::watch;

/// Why the node process stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Membership (store, endpoints, discovery) failed.
    #[error(transparent)]
    Membership(#[from] membership::NodeError),
}

/// What the node process runs besides membership.
#[derive(Clone, Default)]
pub struct Options {
    /// The engine stages run on; `None`: this node runs no stages.
    pub engine: Option<Arc<dyn Engine>>,
    /// Memory offered to models (`--max-memory`); default: what is free at start less
    /// a reserve for the system.
    pub max_memory: Option<u64>,
    /// The GPUs offered to models (each with the VRAM the leader may plan on).
    pub gpus: Vec<shoal_types::GpuOffer>,
    /// Where shards are kept [default: `<data dir>/shards`].
    pub shard_dir: Option<PathBuf>,
    /// Where the HTTP API listens (`None`: no API). Its bound address goes to the file
    /// [`http::HTTP_FILE`] in the data directory.
    pub http: Option<std::net::SocketAddr>,
    /// Who may call the API without a key.
    pub api_access: shoal_api::Access,
    /// Stages keep spinning this long after their last frame (`None`: they sleep).
    pub keepalive: Option<std::time::Duration>,
    /// A hub appliance's folder (`shoal serve --appliance`): the admin page manages the
    /// box's system settings, updates and resets through it, and lets the first
    /// password be set from the LAN. `None`: an ordinary node.
    pub appliance: Option<shoal_admin::Appliance>,
    /// How generations through this node's API speculate unless a request says
    /// otherwise (`None`: they do not; `shoal serve --draft K`).
    pub speculation: Option<shoal_types::SpecSettings>,
}

/// The context the admin sessions' node secret is derived in (see
/// [`shoal_net::Identity::derive_key`]).
const ADMIN_SESSION_CONTEXT: &str = "shoal 2026-12-07 admin session secret";

/// Memory left to the system when the offer is not given.
pub const RESERVE_BYTES: u64 = 512 << 20;

/// Run the node process until `shutdown` completes.
pub async fn run(
    cfg: NodeConfig,
    options: Options,
    identity: Arc<Identity>,
    inventory: watch::Receiver<NodeInventory>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let shared = SharedEndpoint::bind(cfg.listen, identity.clone(), &cfg.transport)?;
    let (handle, inbox) = Handle::new();
    let free = inventory.borrow().ram_available_bytes;
    let offer = options.max_memory.unwrap_or(free.saturating_sub(RESERVE_BYTES));
    // A draft model's room comes out of the offer (at a default load's sizing), so the
    // planner does not fill the memory a coordinator's draft needs.
    let draft_reserve =
        options.engine.as_ref().map_or(0, |e| e.draft_reserve(runtime::DRAFT_RESERVE_SIZING)).min(offer);
    if draft_reserve > 0 && draft_reserve == offer {
        tracing::warn!(
            mib = draft_reserve >> 20,
            "the draft model takes all the memory this node offers: no model's stage will be placed here (raise --max-memory)"
        );
    } else if draft_reserve > 0 {
        tracing::info!(mib = draft_reserve >> 20, "memory kept out of the offer for the draft model");
    }
    let rt = Arc::new(Runtime {
        me: identity.id(),
        node: shared.node.clone(),
        router: shared.router.clone(),
        membership: handle.clone(),
        cache: ShardCache::new(options.shard_dir.clone().unwrap_or_else(|| cfg.data_dir.join("shards"))),
        engine: options.engine.clone(),
        offer_bytes: offer - draft_reserve,
        draft_reserve,
        gpus: options.gpus.clone(),
        stage: Mutex::new(None),
        rss_before_stage: Default::default(),
        keepalive: options.keepalive,
        fingerprint: options.engine.as_ref().map(|e| e.fingerprint()).unwrap_or_default(),
        measuring: Default::default(),
        inventory: inventory.clone(),
        events: Default::default(),
        speculation: options.speculation,
        admin_secret: identity.derive_key(ADMIN_SESSION_CONTEXT),
    });
    let ctx = Arc::new(Ctx { me: identity.id(), membership: handle, rt: rt.clone() });
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(serve_api(shared.router.route(alpn::NODE), ctx));
    tasks.spawn(serve_shards(shared.router.route(alpn::SHARD), rt.clone()));
    tasks.spawn(runtime::lead(rt.clone()));
    tasks.spawn(runtime::offer(rt.clone()));
    tasks.spawn(runtime::supervise(rt.clone()));
    tasks.spawn(events::watch(rt.membership.view(), rt.events.clone()));
    tasks.spawn(notify_ready(rt.membership.view(), identity.id()));
    tasks.spawn(watchdog(rt.membership.clone()));
    let mut cfg = cfg;
    if let Some(addr) = options.http {
        match serve_http(addr, options.api_access.clone(), &cfg.data_dir, rt.clone(), options.appliance.clone()).await {
            Ok((port, task)) => {
                // A hub advertises its page as shoal.local (discovery, started below).
                cfg.web_port = Some(port);
                tasks.spawn(task);
            }
            // The cluster and the stages run without it; the owner reads why.
            Err(e) => {
                tracing::error!("the HTTP API is not served: {e}");
                eprintln!("[shoal] the HTTP API is not served: {e}");
            }
        }
    }
    let main = shared.node.clone();
    let shutdown = async {
        shutdown.await;
        notify::stopping();
    };
    let r = membership::run_shared(cfg, identity, inventory, shared, inbox, shutdown).await;
    // Stages stop with their tasks (and free their memory) before the endpoint closes.
    tasks.shutdown().await;
    main.close();
    // Peers (the next stage, a coordinator) learn of the close now, not at their idle
    // timeout: they re-route and replay at once.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(300), main.wait_idle()).await;
    Ok(r?)
}

/// Tell the service manager (systemd's `Type=notify`, or a lab waiting on
/// `NOTIFY_SOCKET`) that the node serves, once membership has written its endpoint
/// file and started discovery: nothing to wait for by reading logs.
async fn notify_ready(mut view: watch::Receiver<membership::View>, me: NodeId) {
    let Ok(v) = view.wait_for(|v| v.listening.is_some()).await else { return };
    let status = format!("node {me} serving on {}", v.listening.map(|a| a.to_string()).unwrap_or_default());
    drop(v);
    notify::ready(&status);
}

/// systemd's watchdog (`WatchdogSec=` in the unit): while membership's loop answers,
/// tell systemd the node is alive every half period. A loop that hangs stops the pings,
/// and systemd restarts the service. Without the watchdog set, nothing runs.
async fn watchdog(membership: Handle) {
    let Some(period) = notify::watchdog_period() else { return };
    let half = period / 2;
    let mut every = tokio::time::interval(half);
    loop {
        every.tick().await;
        // A real status answer only: "the node is stopping" comes back at once from a
        // membership loop that has ended.
        let answer = tokio::time::timeout(half, membership.ask(AdminRequest::Status)).await;
        if matches!(answer, Ok(AdminResponse::Status(_))) {
            notify::watchdog();
        } else {
            tracing::warn!("membership did not answer within {} s: no watchdog ping", half.as_secs());
        }
    }
}

/// Bind the HTTP API at `addr` and record where; the port bound, and the future that
/// serves it.
async fn serve_http(
    addr: std::net::SocketAddr,
    access: shoal_api::Access,
    data_dir: &std::path::Path,
    rt: Arc<Runtime>,
    appliance: Option<shoal_admin::Appliance>,
) -> Result<(u16, impl Future<Output = ()>), String> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (another server, Ollama maybe, holds the port? use --http-listen)")
    })?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let file = data_dir.join(http::HTTP_FILE);
    std::fs::write(&file, format!("{bound}\n")).map_err(|e| format!("{}: {e}", file.display()))?;
    eprintln!("[shoal] API: http://{bound}");
    let backend = Arc::new(http::NodeBackend {
        rt: rt.clone(),
        texts: Default::default(),
        metrics: shoal_api::Metrics::new(),
        downloads: data_dir.join("models"),
        pull_limits: shoal_catalog::Limits::for_clients(access.private_downloads),
        pulling: Default::default(),
    });
    eprintln!("[shoal] admin page: http://{bound}/admin/");
    // The admin page's routes carry their own login; the API's key check and CORS
    // apply to the API's routes only.
    let page = admin::NodeAdmin::new(rt, backend.clone(), data_dir.join("models"), appliance);
    let router = shoal_api::router(backend.clone(), access).merge(shoal_admin::router(
        Arc::new(page),
        shoal_admin::Config::default(),
        shoal_api::chat_routes(backend),
    ));
    Ok((bound.port(), async move {
        let limits = shoal_api::Limits::default();
        if let Err(e) = shoal_api::serve_router(listener, router, limits, std::future::pending()).await {
            tracing::error!("the HTTP API stopped: {e}");
        }
    }))
}

/// Serve shards to members that fetch them.
async fn serve_shards(mut incoming: Incoming, rt: Arc<Runtime>) {
    let sources = Arc::new(runtime::LiveSources::new(rt.clone()));
    let server = shoal_transfer::Server::new(rt.cache.clone(), sources, shoal_transfer::ServerOptions::default());
    while let Some(acc) = incoming.accept().await {
        // (The endpoint closes a removed member's connections: `close_when_revoked`.)
        let server = server.clone();
        tokio::spawn(async move { server.serve(acc.conn).await });
    }
}

/// What the node protocol's handlers need.
struct Ctx {
    /// This node: its own key is its owner's.
    me: NodeId,
    /// The way into membership.
    membership: Handle,
    /// Placement, stages, generation.
    rt: Arc<Runtime>,
}

/// Serve the node protocol: one request per stream.
async fn serve_api(mut incoming: Incoming, ctx: Arc<Ctx>) {
    while let Some(acc) = incoming.accept().await {
        let ctx = ctx.clone();
        let (owner, peer) = (acc.peer == ctx.me, acc.peer);
        tokio::spawn(async move {
            while let Ok((mut send, mut recv)) = acc.conn.accept_bi().await {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let answer = match read_msg::<NodeRequest>(&mut recv).await {
                        Ok(Some(req)) if !owner && !req.member_may() => NodeResponse::Error(ApiError::new(
                            ErrorKind::Forbidden,
                            "only this node's owner may ask that",
                        )),
                        Ok(Some(NodeRequest::Generate { model, request })) => {
                            generate(&ctx, &model, request, &mut send).await
                        }
                        Ok(Some(NodeRequest::ModelAddWatched { path, name })) => {
                            add_watched(&ctx, &path, name, &mut send).await
                        }
                        Ok(Some(req @ (NodeRequest::Measure { .. } | NodeRequest::ProbeLinks { .. }))) => {
                            // Loads layers or sends megabytes: the leader's call.
                            let leads = ctx.membership.view().borrow().leader == Some(peer);
                            if owner || leads {
                                measure(&ctx, req).await
                            } else {
                                NodeResponse::Error(ApiError::new(
                                    ErrorKind::Forbidden,
                                    "only the leader asks for measurements",
                                ))
                            }
                        }
                        Ok(Some(req)) => handle(&ctx, req).await,
                        Ok(None) => return,
                        Err(e) => {
                            NodeResponse::Error(ApiError::new(ErrorKind::BadRequest, format!("bad request: {e}")))
                        }
                    };
                    let _ = write_msg(&mut send, &answer).await;
                    let _ = send.finish();
                });
            }
        });
    }
}

async fn handle(ctx: &Ctx, req: NodeRequest) -> NodeResponse {
    let result = match req {
        NodeRequest::ModelAdd { path, name } => {
            models::add(ctx.me, &ctx.membership, &path, name).await.map(NodeResponse::Added)
        }
        NodeRequest::ModelList => Ok(NodeResponse::Models(models::list(ctx.me, &ctx.membership.view().borrow()))),
        NodeRequest::ModelRemove { model } => models::remove(&ctx.membership, &model).await.map(NodeResponse::Removed),
        NodeRequest::ModelScan { from } => Ok(models::scan(from).await),
        NodeRequest::ModelImport { from, names } => Ok(models::import(ctx.me, &ctx.membership, from, &names).await),
        NodeRequest::ModelLoad { model, context, sessions, exclude } => {
            runtime::load(&ctx.rt, &model, context, sessions, &exclude).await.map(NodeResponse::Ok)
        }
        NodeRequest::ModelUnload { model } => runtime::unload(&ctx.rt, &model).await.map(NodeResponse::Ok),
        NodeRequest::ModelPlan { model } => runtime::plan_of(&ctx.rt, &model),
        NodeRequest::KeyCreate { name, scope } => keys::create(&ctx.membership, &name, scope)
            .await
            .map(|(key, secret)| NodeResponse::KeyCreated { key, secret }),
        NodeRequest::KeyList => Ok(NodeResponse::Keys(keys::list(&ctx.membership.view().borrow()))),
        NodeRequest::KeyRevoke { name } => {
            keys::revoke(&ctx.membership, &name).await.map(|k| NodeResponse::Keys(vec![k]))
        }
        NodeRequest::ModelHeader { model, offset } => {
            // Reads and parses the file: off the async threads.
            let (me, view) = (ctx.me, ctx.membership.view().borrow().clone());
            tokio::task::spawn_blocking(move || models::header(me, &view, &model, offset))
                .await
                .unwrap_or_else(|e| Err(ApiError::new(ErrorKind::Unavailable, e.to_string())))
        }
        NodeRequest::Stages => Ok(NodeResponse::Stages(runtime::stage_report(&ctx.rt).into_iter().collect())),
        NodeRequest::Breakdowns => Ok(NodeResponse::Breakdowns(runtime::breakdowns(&ctx.rt).await)),
        NodeRequest::Inventory => Ok(NodeResponse::Inventory(Box::new(ctx.rt.inventory.borrow().clone()))),
        NodeRequest::Generate { .. }
        | NodeRequest::ModelAddWatched { .. }
        | NodeRequest::Measure { .. }
        | NodeRequest::ProbeLinks { .. } => {
            Err(ApiError::new(ErrorKind::BadRequest, "served by the connection's loop"))
        }
    };
    result.unwrap_or_else(NodeResponse::Error)
}

/// Measure this node for the leader: its speed on a model, or its links.
async fn measure(ctx: &Ctx, req: NodeRequest) -> NodeResponse {
    match req {
        NodeRequest::Measure { model } => {
            runtime::measure(&ctx.rt, &model).await.map_or_else(NodeResponse::Error, NodeResponse::Measured)
        }
        NodeRequest::ProbeLinks { frame_bytes } => {
            // Membership probes and commits `links/<node>`, as for `shoal plan`.
            match ctx.membership.ask(AdminRequest::ProbeLinks { frame_bytes }).await {
                AdminResponse::Error(e) => NodeResponse::Error(ApiError::new(ErrorKind::Unavailable, e)),
                _ => NodeResponse::Ok("probed".into()),
            }
        }
        _ => NodeResponse::Error(ApiError::new(ErrorKind::BadRequest, "not a measurement")),
    }
}

/// Add a model, sending the hashing's progress as it goes (a few messages a second at
/// most), then the answer.
async fn add_watched(ctx: &Ctx, path: &str, name: Option<String>, send: &mut quinn::SendStream) -> NodeResponse {
    let (tx, mut rx) = tokio::sync::watch::channel((0u64, 0u64));
    let add = models::add_with_progress(ctx.me, &ctx.membership, path, name, move |done, total| {
        let _ = tx.send((done, total));
    });
    tokio::pin!(add);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
    loop {
        tokio::select! {
            answer = &mut add => return answer.map_or_else(NodeResponse::Error, NodeResponse::Added),
            _ = tick.tick() => {
                if !rx.has_changed().unwrap_or(false) {
                    continue;
                }
                let (done, total) = *rx.borrow_and_update();
                if write_msg(send, &NodeResponse::Progress { done, total }).await.is_err() {
                    // The client went away; the file is still added (it asked for that).
                    return add.await.map_or_else(NodeResponse::Error, NodeResponse::Added);
                }
            }
        }
    }
}

/// Forward a generation to the model's coordinator, streaming each token back; the
/// returned message is the last one (the report, or the error).
async fn generate(
    ctx: &Ctx,
    model: &str,
    request: shoal_pipeline::GenerateRequest,
    send: &mut quinn::SendStream,
) -> NodeResponse {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let rt = ctx.rt.clone();
    let model = model.to_string();
    let run = tokio::spawn(async move {
        // Tokens are few (one per step) and the stream drains them as they come: an
        // unbounded channel cannot grow past the generation's length.
        // (The CLI's protocol carries tokens only.)
        runtime::generate(&rt, &model, &request, |t, _| {
            let _ = tx.send(t);
        })
        .await
    });
    while let Some(t) = rx.recv().await {
        if write_msg(send, &NodeResponse::Token(t)).await.is_err() {
            // The client went away: stop the generation (its session is freed).
            run.abort();
            return NodeResponse::Error(ApiError::new(ErrorKind::Unavailable, "the client went away"));
        }
    }
    match run.await {
        Ok(Ok(report)) => NodeResponse::Generated(report),
        Ok(Err(e)) => NodeResponse::Error(e),
        Err(e) => NodeResponse::Error(ApiError::new(ErrorKind::Unavailable, e.to_string())),
    }
}
