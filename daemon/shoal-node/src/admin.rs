//! The node's side of the admin page: [`shoal_admin::AdminBackend`] over the cluster
//! state (the admin credentials, members, catalog, placements) and the machines'
//! own reports, which members answer over the node protocol
//! ([`NodeRequest::Inventory`]).

use crate::api::StageStatus;
use crate::api::{NodeRequest, NodeResponse};
use crate::models;
use crate::runtime::{self, Runtime};
use serde_json::json;
use shoal_admin::{
    Action, ActionError, AuthRecord, Download, Gpu, KeyRow, LogEvent, Machine, ModelCard, NodeCard, Overview,
    PendingNode, StageCard, AUTH_KEY,
};
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_net::NodeId;
use shoal_types::{ModelPlacement, NodeInventory, Offer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The cluster state entry holding the cluster's name (a JSON string).
pub const NAME_KEY: &str = "cluster/name";
/// The cluster state entry that lets every machine call the API without a key (`true`).
pub const API_OPEN_KEY: &str = "settings/api_open";
/// The cluster state entry that turns stages' keep-alive on or off for every node
/// (`"on"` or `"off"`; absent: each node's `--keepalive`).
pub const KEEPALIVE_KEY: &str = "settings/keepalive";

/// Whether the cluster lets every machine call the API without a key.
pub fn api_open(view: &shoal_membership::node::View) -> bool {
    view.state.as_ref().and_then(|s| s.entries.get(API_OPEN_KEY)).and_then(|v| v.as_bool()).unwrap_or(false)
}

/// The cluster's keep-alive setting: `Some(on)`, or `None` (each node's flag).
pub fn keepalive(view: &shoal_membership::node::View) -> Option<bool> {
    match view.state.as_ref().and_then(|s| s.entries.get(KEEPALIVE_KEY)).and_then(|v| v.as_str()) {
        Some("on") => Some(true),
        Some("off") => Some(false),
        _ => None,
    }
}

/// What a member reports of itself: its machine and the stage it runs.
#[derive(Clone, Default)]
pub(crate) struct Report {
    /// Its machine, when it answered.
    inventory: Option<NodeInventory>,
    /// Its stages and their measured memory.
    stages: Vec<StageStatus>,
    /// What its running stages' services say (hop latencies, replays, links).
    services: Vec<shoal_pipeline::NodeStatus>,
}

/// How long a member's report is reused before it is asked again.
const REPORT_FRESH: Duration = Duration::from_secs(5);
/// How long a member may take to report.
const REPORT_WAIT: Duration = Duration::from_millis(1500);

/// The admin page's view of this node.
pub struct NodeAdmin {
    /// Membership, the endpoint, stages.
    pub(crate) rt: Arc<Runtime>,
    /// Members' last reports and when they came (a page refreshes every second;
    /// machines change slower).
    pub(crate) reports: Mutex<HashMap<NodeId, (Instant, Report)>>,
    /// Downloads started from the page, newest last (shared with their tasks).
    pub(crate) downloads: Arc<Mutex<Vec<Download>>>,
    /// The HTTP API's counters (the activity charts).
    pub(crate) api: Arc<crate::http::NodeBackend>,
    /// Where the page's uploads go (`<data dir>/models`, as downloads).
    pub(crate) uploads: std::path::PathBuf,
    /// The hub appliance's folder, on one (`shoal serve --appliance`).
    pub(crate) appliance: Option<shoal_admin::Appliance>,
}

impl shoal_admin::AdminBackend for NodeAdmin {
    fn credentials(&self) -> (Option<String>, Option<AuthRecord>) {
        let view = self.rt.membership.view();
        let view = view.borrow();
        let Some(state) = &view.state else { return (None, None) };
        let record = state.entries.get(AUTH_KEY).map(|v| {
            serde_json::from_value(v.clone()).unwrap_or_else(|e| {
                // Present but unreadable (another version's, or damaged): still a password
                // is set, so the first-run setup stays closed; none can log in until the
                // owner sets one with `shoal password`.
                tracing::warn!(
                    "the admin credentials in the cluster state are unreadable ({e}): set them with `shoal password`"
                );
                AuthRecord { password: String::new(), session_key: String::new(), set_at: 0 }
            })
        });
        (Some(state.cluster.to_string()), record)
    }

    fn session_secret(&self) -> [u8; 32] {
        self.rt.admin_secret
    }

    async fn set_credentials(&self, record: AuthRecord) -> Result<(), String> {
        // Invariant: strings and numbers always serialise.
        let value = serde_json::to_value(&record).expect("a record serialises");
        match self.rt.membership.ask(AdminRequest::Put { key: AUTH_KEY.into(), value }).await {
            AdminResponse::Ok(_) => {}
            AdminResponse::Error(e) => return Err(e),
            other => return Err(format!("unexpected answer from membership: {other:?}")),
        }
        // Committed; wait until this node's view holds it (within a beat).
        let mut view = self.rt.membership.view();
        let holds = |v: &shoal_membership::node::View| {
            v.state.as_ref().and_then(|s| s.entries.get(AUTH_KEY)).and_then(|v| serde_json::from_value(v.clone()).ok())
                == Some(record.clone())
        };
        tokio::time::timeout(Duration::from_secs(10), view.wait_for(holds))
            .await
            .map_err(|_| "stored, but not seen here within 10 s".to_string())?
            .map_err(|_| "the node is stopping".to_string())?;
        Ok(())
    }

    async fn overview(&self) -> Overview {
        let status = match self.rt.membership.ask(AdminRequest::Status).await {
            AdminResponse::Status(s) => *s,
            _ => return Overview { node: self.rt.me.to_string(), ..Overview::default() },
        };
        let view = self.rt.membership.view().borrow().clone();
        let placements = runtime::placements(&view);
        let offers: HashMap<NodeId, Offer> = view
            .state
            .as_ref()
            .map(|s| {
                s.entries
                    .range(Offer::KEY_PREFIX.to_string()..)
                    .take_while(|(k, _)| k.starts_with(Offer::KEY_PREFIX))
                    .filter_map(|(k, v)| {
                        let id = k[Offer::KEY_PREFIX.len()..].parse().ok()?;
                        Some((id, serde_json::from_value(v.clone()).ok()?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut placed: HashMap<NodeId, u64> = HashMap::new();
        for p in placements.values() {
            for s in &p.stages {
                *placed.entry(s.node).or_default() += s.memory_bytes;
            }
        }
        let alive: Vec<NodeId> = status
            .members
            .iter()
            .filter(|m| m.state != shoal_membership::core::Liveness::Down)
            .map(|m| m.node)
            .collect();
        let reports = self.reports(&view, &alive).await;
        let mut nodes: Vec<NodeCard> = status
            .members
            .iter()
            .map(|m| NodeCard {
                id: m.node.to_string(),
                name: m.name.clone(),
                role: m.role.to_string(),
                state: match m.state {
                    shoal_membership::core::Liveness::Alive => "online",
                    shoal_membership::core::Liveness::Suspected => "suspected",
                    shoal_membership::core::Liveness::Down => "down",
                }
                .into(),
                leader: m.leader,
                addr: m.addr.clone(),
                machine: reports.get(&m.node).and_then(|r| r.inventory.clone()).map(machine),
                offered_bytes: offers
                    .get(&m.node)
                    .map(|o| o.memory_bytes + o.gpus.iter().map(|g| g.memory_bytes).sum::<u64>()),
                placed_bytes: placed.get(&m.node).copied().unwrap_or(0),
            })
            .collect();
        // The leader first, then by name: cards keep their places between updates.
        nodes.sort_by(|a, b| b.leader.cmp(&a.leader).then_with(|| a.name.cmp(&b.name)).then_with(|| a.id.cmp(&b.id)));
        let pending = status
            .pending
            .iter()
            .map(|p| PendingNode {
                id: p.node.to_string(),
                name: p.name.clone(),
                role: p.role.to_string(),
                memory_bytes: p.memory_bytes,
                addr: p.addr.clone(),
            })
            .collect();
        let mut models = Vec::new();
        for entry in models::entries(&view) {
            let p = placements.get(&entry.content_hash);
            let state = match p {
                None => "available",
                Some(p) if p.error.is_some() => "unplaced",
                Some(p) if runtime::stages_ready(&self.rt, &view, p).await => "ready",
                Some(_) => "loading",
            };
            models.push(model_card(&entry, p, state, &reports));
        }
        models.sort_by(|a, b| a.name.cmp(&b.name));
        // The last generation through this node's API, by the name the client used (the
        // model's name, or a prefix of its hash).
        let decode = shoal_api::Backend::metrics(&*self.api).last_decode();
        for m in &mut models {
            m.measured_tok_s = decode
                .iter()
                .find(|(asked, _)| **asked == m.name || (asked.len() >= 8 && m.hash.starts_with(asked.as_str())))
                .map(|(_, s)| *s);
        }
        let events = self
            .rt
            .events
            .list()
            .into_iter()
            .map(|e| LogEvent { at_ms: e.at_ms, kind: e.kind, text: e.text })
            .collect();
        let name = view
            .state
            .as_ref()
            .and_then(|s| s.entries.get(NAME_KEY))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        let snap = shoal_api::Backend::metrics(&*self.api).snapshot();
        let mut hops = Vec::new();
        for (hash, p) in &placements {
            let model = models.iter().find(|m| &m.hash == hash).map_or_else(|| hash.clone(), |m| m.name.clone());
            for s in &p.stages {
                let Some(service) =
                    reports.get(&s.node).and_then(|r| r.services.iter().find(|st| st.layers == s.layers))
                else {
                    continue;
                };
                for h in &service.hop_in {
                    hops.push(shoal_admin::Hop {
                        model: model.clone(),
                        node: s.node.to_string(),
                        first: s.layers.start,
                        end: s.layers.end,
                        class: h.class.clone(),
                        frames: h.frames,
                        p50_us: h.p50_us,
                        p99_us: h.p99_us,
                        replays: service.counters.replays,
                        link_connects: service.link_connects,
                    });
                }
            }
        }
        let activity = shoal_admin::Activity {
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            streamed_tokens: snap.streamed_tokens,
            requests: snap.requests,
            failed_requests: snap.failed_requests,
            in_flight: snap.in_flight,
            hops,
        };
        let keys = crate::keys::list(&view)
            .into_iter()
            .map(|k| KeyRow { name: k.name, created_unix: k.created_unix })
            .collect();
        Overview {
            cluster: status.cluster.map(|c| c.to_string()).unwrap_or_default(),
            name,
            node: self.rt.me.to_string(),
            nodes,
            pending,
            models,
            events,
            keys,
            downloads: lock(&self.downloads).clone(),
            activity,
            settings: shoal_admin::Settings {
                api_open: api_open(&view),
                keepalive: match keepalive(&view) {
                    Some(true) => "on",
                    Some(false) => "off",
                    None => "node",
                }
                .into(),
            },
        }
    }

    fn upload_dir(&self) -> std::path::PathBuf {
        self.uploads.clone()
    }

    fn appliance(&self) -> Option<&shoal_admin::Appliance> {
        self.appliance.as_ref()
    }

    async fn act(&self, action: Action) -> Result<serde_json::Value, ActionError> {
        let rt = &self.rt;
        let ask = |req: AdminRequest| async move {
            match rt.membership.ask(req).await {
                AdminResponse::Error(e) => Err(ActionError { status: 409, message: e }),
                other => Ok(other),
            }
        };
        match action {
            Action::Approve { node } => ask(AdminRequest::Approve { node }).await.map(|_| json!({"ok": "let in"})),
            Action::Remove { node } => ask(AdminRequest::Remove { node }).await.map(|_| json!({"ok": "removed"})),
            Action::PairingCode => match ask(AdminRequest::Pair).await? {
                AdminResponse::Code { code, valid_s } => {
                    Ok(json!({"code": code, "valid_s": valid_s, "command": format!("shoal join {code}")}))
                }
                other => Err(ActionError { status: 503, message: format!("unexpected answer: {other:?}") }),
            },
            Action::JoinToken { valid_s } => match ask(AdminRequest::Token { valid_s }).await? {
                AdminResponse::Code { code, valid_s } => Ok(json!({
                    "token": code,
                    "valid_s": valid_s,
                    "command": format!("shoal join {code}"),
                    "service": format!("shoal service install --join {code}"),
                })),
                other => Err(ActionError { status: 503, message: format!("unexpected answer: {other:?}") }),
            },
            Action::ModelAdd { path, name } => {
                models::add(rt.me, &rt.membership, &path, name).await.map(|e| json!({"added": e.name})).map_err(failure)
            }
            Action::ModelLoad { model, context, exclude } => {
                let view = rt.membership.view().borrow().clone();
                let catalog = models::entries(&view);
                let entry = models::find(&catalog, &model).map_err(failure)?;
                let context = context.unwrap_or(crate::http::DEFAULT_CONTEXT.min(entry.context_length.max(16)));
                let hash = entry.content_hash.clone();
                runtime::load(rt, &hash, context, 1, &exclude).await.map(|m| json!({"ok": m})).map_err(failure)
            }
            Action::ModelUnload { model } => {
                runtime::unload(rt, &model).await.map(|m| json!({"ok": m})).map_err(failure)
            }
            Action::ModelRemove { model } => {
                models::remove(&rt.membership, &model).await.map(|e| json!({"removed": e.name})).map_err(failure)
            }
            Action::ModelDownload { source } => self.download(source),
            Action::ModelImport { from } => {
                let kind = match from.as_str() {
                    "ollama" => crate::api::StoreKind::Ollama,
                    "lmstudio" => crate::api::StoreKind::Lmstudio,
                    "hf" => crate::api::StoreKind::Hf,
                    other => return Err(bad(format!("no store {other:?}: ollama, lmstudio or hf"))),
                };
                match models::import(rt.me, &rt.membership, kind, &[]).await {
                    NodeResponse::Imported { added, refused } => Ok(json!({
                        "added": added.into_iter().map(|e| e.name).collect::<Vec<_>>(),
                        "refused": refused,
                    })),
                    NodeResponse::Error(e) => Err(failure(e)),
                    other => Err(ActionError { status: 503, message: format!("unexpected answer: {other:?}") }),
                }
            }
            Action::KeyCreate { name, scope } => crate::keys::create(&rt.membership, &name, scope)
                .await
                .map(|(key, secret)| json!({"name": key.name, "secret": secret, "scope": key.scope}))
                .map_err(failure),
            Action::KeyRevoke { name } => {
                crate::keys::revoke(&rt.membership, &name).await.map(|k| json!({"revoked": k.name})).map_err(failure)
            }
            Action::PlanPreview { model, context, exclude } => {
                let view = rt.membership.view().borrow().clone();
                let catalog = models::entries(&view);
                let entry = models::find(&catalog, &model).map_err(failure)?.clone();
                let p = runtime::what_if(rt, &model, context, &exclude).map_err(failure)?;
                let card = model_card(&entry, Some(&p), "proposed", &HashMap::new());
                // Invariant: plain data always serialises.
                Ok(serde_json::to_value(card).expect("a card serialises"))
            }
            Action::ApiOpen { open } => {
                let req = if open {
                    AdminRequest::Put { key: API_OPEN_KEY.into(), value: json!(true) }
                } else {
                    AdminRequest::Delete { key: API_OPEN_KEY.into() }
                };
                ask(req).await.map(|_| json!({"api_open": open}))
            }
            Action::KeepAlive { mode } => {
                let req = match mode.as_str() {
                    "on" | "off" => AdminRequest::Put { key: KEEPALIVE_KEY.into(), value: json!(mode) },
                    "node" => AdminRequest::Delete { key: KEEPALIVE_KEY.into() },
                    other => return Err(bad(format!("keep-alive {other:?}: on, off or node"))),
                };
                ask(req).await.map(|_| json!({"keepalive": mode}))
            }
            Action::ClusterName { name } => {
                let name = shoal_admin::cluster_name(&name).map_err(bad)?;
                ask(AdminRequest::Put { key: NAME_KEY.into(), value: json!(name) }).await.map(|_| json!({"name": name}))
            }
            action @ (Action::ApplianceSettings { .. }
            | Action::ApplianceUpdate
            | Action::ApplianceReset
            | Action::ApplianceReboot) => shoal_admin::appliance::act(self.appliance.as_ref(), action).await,
        }
    }
}

impl NodeAdmin {
    /// Start downloading `source` into the uploads folder (the node's models folder),
    /// then add it; its progress goes to [`NodeAdmin::downloads`].
    fn download(&self, source: String) -> Result<serde_json::Value, ActionError> {
        let scheme_ok = ["https://", "http://", "hf://"].iter().any(|s| source.starts_with(s));
        if !scheme_ok || source.len() > 2048 || source.chars().any(char::is_control) {
            return Err(bad("give an https:// URL of a GGUF file, or hf://org/repo/file.gguf".into()));
        }
        let downloads = self.downloads.clone();
        {
            let mut list = lock(&downloads);
            // Two sources of one file name would write one `NAME.part`.
            let file = file_name(&source);
            if let Some(d) = list.iter().find(|d| d.state == "running" && file_name(&d.source) == file) {
                return Err(ActionError {
                    status: 409,
                    message: format!("{file} is being downloaded already ({})", d.source),
                });
            }
            // The newest finished ones are kept, 20 entries in all: the list is for the
            // page, not a history; running ones always stay.
            while list.len() >= 20 {
                let Some(i) = list.iter().position(|d| d.state != "running") else { break };
                list.remove(i);
            }
            list.push(Download { source: source.clone(), state: "running".into(), ..Download::default() });
        }
        let (rt, dest) = (self.rt.clone(), self.uploads.clone());
        let finished = source.clone();
        tokio::spawn(async move {
            let (list, url) = (downloads.clone(), source.clone());
            let update = move |list: &Arc<Mutex<Vec<Download>>>, f: &dyn Fn(&mut Download)| {
                if let Some(d) = lock(list).iter_mut().rev().find(|d| d.source == source && d.state == "running") {
                    f(d);
                }
            };
            let fetched = tokio::task::spawn_blocking(move || {
                shoal_catalog::download(&url, &dest, &mut |p| {
                    update(&list, &|d| {
                        d.done = p.done;
                        d.total = p.total;
                    })
                })
            })
            .await;
            let path = match fetched {
                Ok(Ok(d)) => Ok(d.path),
                // Downloaded before: the file is whole; adding it again checks it.
                Ok(Err(shoal_catalog::DownloadError::Exists(path))) => Ok(path),
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let result = match path {
                Ok(path) => models::add(rt.me, &rt.membership, &path.display().to_string(), None)
                    .await
                    .map(|e| e.name)
                    .map_err(|e| e.message),
                Err(e) => Err(e),
            };
            let mut list = lock(&downloads);
            if let Some(d) = list.iter_mut().rev().find(|d| d.state == "running" && d.source == finished) {
                match result {
                    Ok(name) => {
                        d.state = "added".into();
                        d.message = name;
                    }
                    Err(why) => {
                        d.state = "failed".into();
                        d.message = why;
                    }
                }
            }
        });
        Ok(json!({"started": true}))
    }
}

/// The file name a download of `source` takes: its last path component, without a
/// query or a revision.
fn file_name(source: &str) -> &str {
    let path = source.split(['?', '#']).next().unwrap_or(source);
    path.rsplit('/').next().unwrap_or(path)
}

/// A bad request.
fn bad(message: String) -> ActionError {
    ActionError { status: 400, message }
}

/// A node error as the page's action answers it.
fn failure(e: crate::api::ApiError) -> ActionError {
    use crate::api::ErrorKind;
    let status = match e.kind {
        ErrorKind::BadRequest | ErrorKind::Refused => 400,
        ErrorKind::Forbidden => 403,
        ErrorKind::NotFound => 404,
        ErrorKind::Conflict => 409,
        ErrorKind::Busy => 429,
        ErrorKind::Unavailable => 503,
    };
    ActionError { status, message: e.message }
}

impl NodeAdmin {
    /// The admin page's backend for the node `rt` serving the API `api`, uploads going
    /// to `uploads`; on a hub appliance, its folder.
    pub fn new(
        rt: Arc<Runtime>,
        api: Arc<crate::http::NodeBackend>,
        uploads: std::path::PathBuf,
        appliance: Option<shoal_admin::Appliance>,
    ) -> NodeAdmin {
        NodeAdmin { rt, reports: Mutex::new(HashMap::new()), uploads, downloads: Arc::default(), api, appliance }
    }

    /// The reports of `members` (this node's own from its inventory and stage),
    /// asking those not heard from within [`REPORT_FRESH`], all at once, each for at
    /// most [`REPORT_WAIT`]. A member that does not answer keeps its last report.
    async fn reports(&self, view: &shoal_membership::node::View, members: &[NodeId]) -> HashMap<NodeId, Report> {
        let now = Instant::now();
        let stale: Vec<NodeId> = {
            let cache = lock(&self.reports);
            members
                .iter()
                .filter(|id| **id != self.rt.me)
                .filter(|id| cache.get(id).is_none_or(|(at, _)| now.duration_since(*at) > REPORT_FRESH))
                .copied()
                .collect()
        };
        let asks = stale.into_iter().filter_map(|id| {
            let addr = view.addrs.get(&id).copied()?;
            let node = self.rt.node.clone();
            Some(async move {
                let ask = async {
                    let conn = node.connect(addr, id, shoal_net::alpn::NODE).await.ok()?;
                    let one = |req: NodeRequest| {
                        let conn = conn.clone();
                        async move {
                            let (mut send, mut recv) = conn.open_bi().await.ok()?;
                            shoal_membership::wire::write_msg(&mut send, &req).await.ok()?;
                            let _ = send.finish();
                            shoal_membership::wire::read_msg::<NodeResponse>(&mut recv).await.ok().flatten()
                        }
                    };
                    let (inv, stages) = tokio::join!(one(NodeRequest::Inventory), one(NodeRequest::Stages));
                    Some(Report {
                        inventory: match inv {
                            Some(NodeResponse::Inventory(i)) => Some(*i),
                            _ => None,
                        },
                        stages: match stages {
                            Some(NodeResponse::Stages(s)) => s,
                            _ => Vec::new(),
                        },
                        services: Vec::new(),
                    })
                };
                (id, tokio::time::timeout(REPORT_WAIT, ask).await.ok().flatten())
            })
        });
        let mut answers = futures_util::future::join_all(asks).await;
        // Then the running stages' services, all at once (this node's own among them).
        let mine = Report {
            inventory: Some(self.rt.inventory.borrow().clone()),
            stages: runtime::stage_report(&self.rt).into_iter().collect(),
            services: Vec::new(),
        };
        answers.push((self.rt.me, Some(mine)));
        let running = |st: &&StageStatus| st.state == crate::api::StageState::Running;
        let services = answers.iter().flat_map(|(id, r)| {
            r.iter().flat_map(|r| r.stages.iter().filter(running)).map(move |st| {
                let (id, layers) = (*id, st.layers);
                async move { (id, runtime::stage_status(&self.rt, view, id, layers, REPORT_WAIT).await) }
            })
        });
        for (id, status) in futures_util::future::join_all(services).await {
            if let (Some(status), Some((_, Some(r)))) = (status, answers.iter_mut().find(|(n, _)| *n == id)) {
                r.services.push(status);
            }
        }
        let mine = answers.pop().and_then(|(_, r)| r).unwrap_or_default();
        let mut cache = lock(&self.reports);
        for (id, report) in answers {
            let keep = report.or_else(|| cache.get(&id).map(|(_, old)| old.clone())).unwrap_or_default();
            cache.insert(id, (now, keep));
        }
        cache.retain(|id, _| members.contains(id));
        let mut out: HashMap<NodeId, Report> =
            members.iter().filter_map(|id| cache.get(id).map(|(_, r)| (*id, r.clone()))).collect();
        out.insert(self.rt.me, mine);
        out
    }
}

/// A machine's report as the page shows it.
fn machine(inv: NodeInventory) -> Machine {
    Machine {
        version: inv.shoal_version,
        os: inv.os,
        cpu: inv.cpu_model,
        cores: inv.cpu_cores,
        cpu_percent: inv.cpu_used_permille.map(|p| p as f32 / 10.0),
        ram_total: inv.ram_total_bytes,
        ram_available: inv.ram_available_bytes,
        gpus: inv
            .gpus
            .into_iter()
            .map(|g| Gpu {
                name: if g.description.is_empty() { g.name } else { g.description },
                total: g.total_bytes,
                free: g.free_bytes,
            })
            .collect(),
    }
}

/// A catalog entry with its placement, as the page shows it.
fn model_card(
    entry: &shoal_types::CatalogEntry,
    p: Option<&ModelPlacement>,
    state: &str,
    reports: &HashMap<NodeId, Report>,
) -> ModelCard {
    // What the stage's node says of the stage it runs for this placement.
    let measured = |s: &shoal_types::PlacedStage| {
        let p = p?;
        reports
            .get(&s.node)?
            .stages
            .iter()
            .find(|st| st.model == p.model && st.generation == p.generation && st.layers == s.layers)
            .cloned()
    };
    ModelCard {
        name: entry.name.clone(),
        hash: entry.content_hash.clone(),
        size: entry.size,
        arch: entry.arch.clone(),
        layers: entry.n_layer,
        state: state.into(),
        error: p.and_then(|p| p.error.clone()),
        stages: p
            .map(|p| {
                p.stages
                    .iter()
                    .map(|s| {
                        let st = measured(s);
                        StageCard {
                            node: s.node.to_string(),
                            layers: format!("{}-{}", s.layers.start, s.layers.end),
                            first: s.layers.start,
                            end: s.layers.end,
                            memory_bytes: s.memory_bytes,
                            state: st.as_ref().map(|st| format!("{:?}", st.state).to_lowercase()),
                            loaded_bytes: st.as_ref().and_then(|st| st.loaded_bytes),
                            resident_bytes: st.as_ref().and_then(|st| st.resident_bytes),
                            // Already a mean per step (it was divided by the steps
                            // again once, which showed 0.0-0.1 ms for ~5 ms stages).
                            decode_ms: reports
                                .get(&s.node)
                                .and_then(|r| r.services.iter().find(|n| n.layers == s.layers))
                                .and_then(shoal_pipeline::NodeStatus::compute_ms_per_step),
                            draft: st.as_ref().and_then(|st| st.draft.as_ref()).map(|d| match d {
                                crate::api::DraftState::Loaded { file, bytes, .. } => {
                                    format!("drafts with {file} ({})", shoal_types::fmt_size(*bytes))
                                }
                                crate::api::DraftState::NotLoaded(why) => {
                                    format!("its draft model did not load: {why}")
                                }
                            }),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default(),
        predicted_tok_s: p.filter(|p| !p.stages.is_empty()).map(|p| p.predicted_tok_s),
        explanation: p.map(|p| p.explanation.clone()).unwrap_or_default(),
        measured_tok_s: None,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map operation: a panic leaves the map whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
