//! What makes the cluster run models by itself:
//! - on the leader, a loop that runs the pure [`schedule`](crate::schedule) whenever
//!   membership or the loads change, and commits its decisions;
//! - on every node, a supervisor that reconciles the committed placements with the
//!   stage it runs: it obtains the shard of its layers (from its cache, cut from its own
//!   copy of the model, or fetched from a member that holds one), loads it through the
//!   [`Engine`] the binary provides, and serves it on the shared endpoint;
//! - the shard server other nodes fetch from, and the forwarding of generations to a
//!   model's coordinator.

use crate::api::{ApiError, DraftState, ErrorKind, NodeResponse, StageState, StageStatus};
use crate::models;
use crate::schedule::{self, Decision, Inputs, MemberFacts};
use shoal_gguf::{ShardCache, SourceHash};
use shoal_membership::node::{Handle, View};
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_net::{Dtype, Node, NodeId, Router};
use shoal_pipeline::{GenerateRequest, Placement, Report, RetryPolicy, SamplerFactory, ServiceConfig, StagePlace};
use shoal_planner::ModelProfile;
use shoal_types::{CatalogEntry, GpuShare, LayerRange, LoadSpec, ModelPlacement, Offer, Stage};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Key prefix of the planner profiles of catalog models (`model-profile/<hash>`),
/// written by the node that adds a model, so the leader plans without the file.
pub const PROFILE_PREFIX: &str = "model-profile/";

/// How a stage's context is sized (from the placement).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageSizing {
    /// Positions per session.
    pub context: u32,
    /// Sessions held at once.
    pub sessions: u32,
    /// Prefill chunk size C.
    pub chunk: u32,
}

/// A draft model a node loaded for the generations it coordinates ([`Engine::drafts`]).
pub struct LoadedDraft {
    /// Where its proposers come from.
    pub source: Arc<dyn shoal_types::speculative::DraftSource>,
    /// Its file's name, for the stage's status.
    pub file: String,
    /// What it holds (weights, KV cache, compute buffers), bytes.
    pub bytes: u64,
}

/// The inference engine, provided by the binary (llama.cpp) or a test (a fake one):
/// this crate never links llama.cpp.
pub trait Engine: Send + Sync {
    /// Load the stage of `layers` (of a model of `n_layer` blocks) from the shard at
    /// `shard`, its last layers on the GPUs `gpus` names (none: all on the CPU).
    /// Blocking: called on a blocking thread.
    fn load(
        &self,
        shard: &Path,
        layers: LayerRange,
        n_layer: u32,
        sizing: StageSizing,
        gpus: &[GpuShare],
    ) -> Result<Box<dyn Stage>, String>;
    /// Samplers for the tail of the model whose file (or shard) is `gguf` (a grammar
    /// is read against its vocabulary).
    fn samplers(&self, gguf: &Path) -> SamplerFactory;
    /// A draft model for the generations this node coordinates of the model whose
    /// vocabulary is in `shard` (its first stage) and whose GGUF takes `model_bytes`:
    /// the first of the node's draft models that shares the vocabulary, loaded for the
    /// stage's `sizing` if it needs at most `room` bytes. `Ok(None)`: none given, or
    /// none shares the vocabulary; `Err`: one does but does not fit or load. Blocking.
    fn drafts(
        &self,
        shard: &Path,
        model_bytes: u64,
        sizing: StageSizing,
        room: u64,
    ) -> Result<Option<LoadedDraft>, String> {
        let _ = (shard, model_bytes, sizing, room);
        Ok(None)
    }
    /// Memory to keep out of this node's offer for its draft models: the most one of
    /// them takes at `sizing` (the default load's). The planner then leaves room for
    /// the draft on whichever node coordinates. Blocking (reads GGUF headers).
    fn draft_reserve(&self, sizing: StageSizing) -> u64 {
        let _ = sizing;
        0
    }
    /// What the speed of this engine's stages depends on besides the machine (threads,
    /// backends), e.g. "threads=8": a speed measured under another is stale.
    fn fingerprint(&self) -> String {
        String::new()
    }
    /// The vocabulary and chat template of the GGUF at `gguf` (a model or a shard of
    /// it), loaded without weights, for the HTTP API. Blocking.
    fn text(&self, gguf: &Path) -> Result<Arc<dyn shoal_api::TextModel>, String> {
        Err(format!("{}: this engine reads no vocabulary", gguf.display()))
    }
}

/// What the runtime's tasks share.
pub struct Runtime {
    /// This node.
    pub me: NodeId,
    /// The shared endpoint.
    pub node: Arc<Node>,
    /// Its router (stages take the pipeline and control protocols from it).
    pub router: Router,
    /// The way into membership.
    pub membership: Handle,
    /// Shards kept on this node.
    pub cache: ShardCache,
    /// The engine; `None`: this node runs no stages (it still places and forwards).
    pub engine: Option<Arc<dyn Engine>>,
    /// Memory this node offers to the planner for models' stages.
    pub offer_bytes: u64,
    /// Memory kept out of the offer for a draft model ([`Engine::draft_reserve`]): a
    /// coordinating stage's draft loads into it plus what the plan left of the offer.
    pub draft_reserve: u64,
    /// The GPUs this node offers to models.
    pub gpus: Vec<shoal_types::GpuOffer>,
    /// The stage this node runs, as `Stages` reports it.
    pub stage: Mutex<Option<StageStatus>>,
    /// This process's resident memory just before its stage loaded (0: none loaded):
    /// the stage's own resident memory is the growth since (a node runs one stage).
    pub rss_before_stage: std::sync::atomic::AtomicU64,
    /// Keep the stage's threads spinning for this long after its last frame (no
    /// wake-up cost between tokens; see `shoal-lab bench keepalive`); `None`: sleep.
    pub keepalive: Option<std::time::Duration>,
    /// What this node's measured speeds depend on ([`Engine::fingerprint`]): a speed
    /// measured under another (other threads, another build) is measured again.
    pub fingerprint: String,
    /// Held while a measurement ([`measure`]) runs: the next waits (two would time
    /// each other; a leader may ask for several models, or a new leader again).
    pub measuring: tokio::sync::Mutex<()>,
    /// What this machine has, refreshed by the binary (members ask for it: the admin
    /// page's machine cards).
    pub inventory: tokio::sync::watch::Receiver<shoal_types::NodeInventory>,
    /// What changed in the cluster as this node saw it (the admin page's log).
    pub events: crate::events::Log,
    /// How API generations speculate unless a request says otherwise (`Options`).
    pub speculation: Option<shoal_types::SpecSettings>,
    /// This node's own secret for its admin sessions ([`shoal_admin::AdminBackend::session_secret`]).
    pub admin_secret: [u8; 32],
}

impl Runtime {
    fn view(&self) -> View {
        self.membership.view().borrow().clone()
    }

    /// This node's own address as peers dial it (the endpoint's, with loopback for an
    /// unspecified IP: peers learn the real one from the handshake).
    pub(crate) fn own_addr(&self) -> Option<SocketAddr> {
        let mut a = self.node.local_addr().ok()?;
        if a.ip().is_unspecified() {
            a.set_ip(if a.is_ipv4() {
                IpAddr::from([127, 0, 0, 1])
            } else {
                IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
            });
        }
        Some(a)
    }

    fn addr_of(&self, view: &View, node: NodeId) -> Option<SocketAddr> {
        if node == self.me {
            self.own_addr()
        } else {
            view.addrs.get(&node).copied()
        }
    }
}

/// Typed entries of the state under `prefix` (malformed ones skipped).
fn typed<T: serde::de::DeserializeOwned>(view: &View, prefix: &str) -> BTreeMap<String, T> {
    let Some(state) = &view.state else { return BTreeMap::new() };
    state
        .entries
        .range(prefix.to_string()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .filter_map(|(k, v)| Some((k[prefix.len()..].to_string(), serde_json::from_value(v.clone()).ok()?)))
        .collect()
}

/// The committed placements.
pub fn placements(view: &View) -> BTreeMap<String, ModelPlacement> {
    typed(view, ModelPlacement::KEY_PREFIX)
}

/// The scheduler's inputs as `view` holds them.
fn inputs(view: &View) -> Inputs {
    let offers: BTreeMap<String, Offer> = typed(view, Offer::KEY_PREFIX);
    let members = view
        .state
        .as_ref()
        .map(|s| {
            s.members
                .values()
                .map(|m| {
                    let offer = offers.get(&m.id.to_string());
                    MemberFacts {
                        id: m.id,
                        name: m.name.clone(),
                        alive: view.alive.contains(&m.id),
                        // Nothing until the member published its offer: the advert's memory
                        // is the whole machine's, and a member that just joined would look
                        // like it could hold anything (a re-plan would pick it before it
                        // said what it gives).
                        offer_bytes: offer.map_or(0, |o| o.memory_bytes),
                        gpus: offer.map(|o| o.gpus.clone()).unwrap_or_default(),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Inputs {
        loads: typed::<LoadSpec>(view, LoadSpec::KEY_PREFIX).into_values().collect(),
        catalog: models::entries(view).into_iter().map(|e| (e.content_hash.clone(), e)).collect(),
        profiles: typed(view, PROFILE_PREFIX),
        placements: placements(view),
        members,
        idle: BTreeSet::new(),
        speeds: typed::<shoal_types::Speed>(view, shoal_types::Speed::KEY_PREFIX)
            .into_iter()
            .filter_map(|(k, v)| {
                let (node, model) = k.split_once('/')?;
                Some(((node.parse().ok()?, model.to_string()), v))
            })
            .collect(),
        measuring: BTreeSet::new(),
        links: typed::<shoal_membership::node::LinksEntry>(view, shoal_membership::node::LinksEntry::KEY_PREFIX)
            .into_iter()
            .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
            .collect(),
        probing: BTreeSet::new(),
        returning: BTreeSet::new(),
        index: view.state.as_ref().map_or(0, |s| s.version.index),
    }
}

/// On the leader: schedule whenever the view changes, and commit the decisions. Before
/// a model is planned, the free members time a few of its layers (asked here, in the
/// background; the plan waits for their answers, or until [`MEASURE_WAIT`]).
pub async fn lead(rt: Arc<Runtime>) {
    let mut view = rt.membership.view();
    // Measurements asked and not answered, answered but maybe not in the view yet (the
    // member commits its entry before it answers, but this node may apply it a beat
    // later), and failed (not asked again before MEASURE_RETRY: the member is planned
    // with an estimate meanwhile).
    let mut asked: BTreeSet<(NodeId, String)> = BTreeSet::new();
    let mut answered: BTreeMap<(NodeId, String), shoal_types::Speed> = BTreeMap::new();
    let mut failed: BTreeMap<(NodeId, String), tokio::time::Instant> = BTreeMap::new();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    // Link probes, one at a time (two would time each other): the member probing now,
    // and the members probed lately, until when they are not asked again (a success
    // shows in the view a beat later; a failure waits MEASURE_RETRY).
    let mut probe_now: Option<NodeId> = None;
    let mut probed: BTreeMap<NodeId, tokio::time::Instant> = BTreeMap::new();
    let (probe_tx, mut probe_rx) = tokio::sync::mpsc::unbounded_channel::<(NodeId, Result<(), String>)>();
    // Members seen down, and since when (as this node saw them go): within
    // DOWN_GRACE a placement with no spare waits for them.
    let mut down_since: BTreeMap<NodeId, tokio::time::Instant> = BTreeMap::new();
    loop {
        let v = view.borrow_and_update().clone();
        // When the earliest grace ends: the placements are looked at again then.
        let mut grace_ends: Option<tokio::time::Instant> = None;
        // Models a fresh plan would beat clearly: re-planned only once idle, so their
        // coordinators are asked, and asked again a little later while they are busy.
        let mut waiting_for_idle = false;
        if v.leader == Some(rt.me) && v.state.is_some() {
            let mut i = inputs(&v);
            let now = tokio::time::Instant::now();
            down_since.retain(|n, _| !v.alive.contains(n));
            for m in &i.members {
                if !m.alive {
                    down_since.entry(m.id).or_insert(now);
                }
            }
            for (n, since) in &down_since {
                let ends = *since + schedule::DOWN_GRACE;
                if ends > now {
                    i.returning.insert(*n);
                    grace_ends = Some(grace_ends.map_or(ends, |e| e.min(ends)));
                }
            }
            answered.retain(|k, _| !i.speeds.contains_key(k));
            i.speeds.extend(answered.iter().map(|(k, s)| (k.clone(), s.clone())));
            failed.retain(|_, at| at.elapsed() < MEASURE_RETRY);
            // A member that died with an ask out does not hold plans back.
            asked.retain(|(n, _)| v.alive.contains(n));
            i.measuring = asked.clone();
            for pair in schedule::to_measure(&i) {
                // One ask at a time per member (it measures one model after the other).
                if failed.contains_key(&pair) || asked.iter().any(|(n, _)| *n == pair.0) {
                    continue;
                }
                tracing::info!(node = %pair.0, model = %pair.1, "asking for a measurement");
                asked.insert(pair.clone());
                let (rt, done) = (rt.clone(), done_tx.clone());
                tokio::spawn(async move {
                    let r = tokio::time::timeout(MEASURE_WAIT, ask_measure(&rt, pair.0, &pair.1)).await;
                    let _ = done.send((pair, r.unwrap_or_else(|_| Err("no answer in time".into()))));
                });
            }
            i.measuring = asked.clone();
            probed.retain(|_, until| tokio::time::Instant::now() < *until);
            let tried: BTreeSet<NodeId> = probed.keys().copied().collect();
            let queue = schedule::to_probe(&i, probe_now, &tried);
            // After the speed measurements: a busy CPU would slow the echoes.
            if let (None, Some(&next), true) = (probe_now, queue.first(), asked.is_empty()) {
                let frame_bytes = i
                    .loads
                    .iter()
                    .find_map(|l| i.profiles.get(&l.model))
                    .map_or(4096, |p| p.n_embd.saturating_mul(4).clamp(1, shoal_net::probe::MAX_FRAME_BYTES));
                tracing::info!(node = %next, "asking for a link probe");
                probe_now = Some(next);
                let (rt, done) = (rt.clone(), probe_tx.clone());
                tokio::spawn(async move {
                    let req = crate::api::NodeRequest::ProbeLinks { frame_bytes };
                    let r = match tokio::time::timeout(PROBE_WAIT, ask_node(&rt, next, &req)).await {
                        Ok(Ok(NodeResponse::Ok(_))) => Ok(()),
                        Ok(Ok(NodeResponse::Error(e))) => Err(e.message),
                        Ok(Ok(other)) => Err(format!("an unexpected answer {other:?}")),
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err("no answer in time".into()),
                    };
                    let _ = done.send((next, r));
                });
            }
            i.probing = probe_now.into_iter().chain(queue).collect();
            let better = schedule::better_if_idle(&i);
            if !better.is_empty() {
                i.idle = idle_models(&rt, &v, &i.placements, &better).await;
                waiting_for_idle = i.idle.len() < better.len();
            }
            for decision in schedule::schedule(&i) {
                let req = match &decision {
                    Decision::Place(p) => {
                        tracing::info!(model = %p.model, generation = p.generation, stages = p.stages.len(), error = ?p.error, "placing");
                        match serde_json::to_value(p) {
                            Ok(value) => AdminRequest::Put { key: p.key(), value },
                            Err(_) => continue,
                        }
                    }
                    Decision::Remove(model) => {
                        AdminRequest::Delete { key: format!("{}{model}", ModelPlacement::KEY_PREFIX) }
                    }
                };
                if let AdminResponse::Error(e) = rt.membership.ask(req).await {
                    tracing::warn!("committing a placement failed: {e}");
                }
            }
        }
        let recheck = async {
            let idle = waiting_for_idle.then(|| tokio::time::Instant::now() + IDLE_RECHECK);
            match idle.into_iter().chain(grace_ends).min() {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            changed = view.changed() => if changed.is_err() { return },
            Some((pair, answer)) = done_rx.recv() => {
                asked.remove(&pair);
                match answer {
                    Ok(speed) => {
                        answered.insert(pair, speed);
                    }
                    Err(e) => {
                        tracing::info!(node = %pair.0, "no measurement: {e}; its speed is estimated");
                        failed.insert(pair, tokio::time::Instant::now());
                    }
                }
            }
            Some((node, answer)) = probe_rx.recv() => {
                probe_now = None;
                if let Err(e) = answer {
                    tracing::info!(%node, "no link probe: {e}; its links are assumed");
                }
                // Tried, whatever came of it: a link it could not measure is left to the
                // other end, and this member is not asked again for a while.
                probed.insert(node, tokio::time::Instant::now() + MEASURE_RETRY);
            }
            () = recheck => {}
        }
    }
}

/// How long the leader waits for a member's measurement before it plans without it.
pub const MEASURE_WAIT: Duration = Duration::from_secs(120);

/// How long the leader waits for a member's link probe (a few seconds per peer when
/// the links work; a minute per peer at most when they do not).
const PROBE_WAIT: Duration = Duration::from_secs(300);

/// How long a member whose measurement failed is planned with an estimate before it is
/// asked again.
const MEASURE_RETRY: Duration = Duration::from_secs(600);

/// Ask member `node` to measure `model`; its answer, checked.
async fn ask_measure(rt: &Runtime, node: NodeId, model: &str) -> Result<shoal_types::Speed, String> {
    let req = crate::api::NodeRequest::Measure { model: model.to_string() };
    match ask_node(rt, node, &req).await? {
        NodeResponse::Measured(speed) if speed.is_sane() => Ok(speed),
        NodeResponse::Error(e) => Err(e.message),
        other => Err(format!("an unexpected answer {other:?}")),
    }
}

/// Send member `node` one node-protocol request; its answer.
async fn ask_node(rt: &Runtime, node: NodeId, req: &crate::api::NodeRequest) -> Result<NodeResponse, String> {
    use shoal_membership::wire::{read_msg, write_msg};
    // A member that just joined may not have its address in the view yet.
    let mut tries = 0;
    let addr = loop {
        if let Some(a) = rt.addr_of(&rt.view(), node) {
            break a;
        }
        tries += 1;
        if tries > 50 {
            return Err("its address is not known".into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let conn = rt.node.connect(addr, node, shoal_net::alpn::NODE).await.map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    write_msg(&mut send, req).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    let answer = read_msg::<NodeResponse>(&mut recv).await.map_err(|e| e.to_string())?;
    conn.close(0u32.into(), b"done");
    answer.ok_or_else(|| "no answer".into())
}

/// How often the leader asks again whether a model it would move to a clearly better
/// plan has become idle.
const IDLE_RECHECK: Duration = Duration::from_secs(2);

/// Which of `models` are idle: their coordinator (first stage) holds no session and
/// queues nothing, as its stage service says. A coordinator that does not answer
/// counts as busy (nothing is moved on a guess).
async fn idle_models(
    rt: &Runtime,
    view: &View,
    placements: &BTreeMap<String, ModelPlacement>,
    models: &BTreeSet<String>,
) -> BTreeSet<String> {
    let mut idle = BTreeSet::new();
    for model in models {
        let Some(first) = placements.get(model).and_then(|p| p.stages.first()) else { continue };
        if let Some(st) = stage_status(rt, view, first.node, first.layers, Duration::from_secs(2)).await {
            if st.sessions == 0 && st.waiting == 0 {
                idle.insert(model.clone());
            }
        }
    }
    idle
}

/// What the stage service of `node` running `layers` says of its sessions and queue,
/// or `None` when it is unknown, unreachable or silent for `within`.
pub(crate) async fn stage_status(
    rt: &Runtime,
    view: &View,
    node: NodeId,
    layers: LayerRange,
    within: Duration,
) -> Option<shoal_pipeline::NodeStatus> {
    let addr = rt.addr_of(view, node)?;
    let place = StagePlace { node, addr, layers };
    tokio::time::timeout(within, shoal_pipeline::status(&rt.node, &place)).await.ok()?.ok()
}

/// How long [`breakdowns`] waits for each stage's node.
const BREAKDOWN_WAIT: Duration = Duration::from_secs(3);

/// Where each placed model's decode steps spend their time: every stage's status,
/// asked at once, added up round the ring ([`shoal_pipeline::TokenBreakdown`]).
pub async fn breakdowns(rt: &Runtime) -> Vec<(String, shoal_pipeline::TokenBreakdown)> {
    let view = rt.view();
    let catalog = models::entries(&view);
    let mut out = Vec::new();
    for (hash, p) in placements(&view) {
        let asks = p.stages.iter().map(|s| stage_status(rt, &view, s.node, s.layers, BREAKDOWN_WAIT));
        let ring: Option<Vec<_>> = futures_util::future::join_all(asks).await.into_iter().collect();
        if let Some(b) = ring.as_deref().and_then(shoal_pipeline::TokenBreakdown::of) {
            let name = catalog.iter().find(|e| e.content_hash == hash).map_or(hash, |e| e.name.clone());
            out.push((name, b));
        }
    }
    out
}

/// Publish this node's offer once it is a member (and whenever it differs).
pub async fn offer(rt: Arc<Runtime>) {
    let mut view = rt.membership.view();
    // This node's speeds measured under another fingerprint (other threads, another
    // build) are dropped once: the leader measures a free member again when it lacks
    // them (a second or so).
    let mut stale_speeds = true;
    loop {
        let v = view.borrow_and_update().clone();
        if let (Some(state), true, true) = (&v.state, stale_speeds, v.leader.is_some()) {
            let mine = format!("{}{}/", shoal_types::Speed::KEY_PREFIX, rt.me);
            let keys: Vec<String> = state
                .entries
                .range(mine.clone()..)
                .take_while(|(k, _)| k.starts_with(&mine))
                .filter(|(_, v)| {
                    let speed = serde_json::from_value::<shoal_types::Speed>((*v).clone());
                    speed.map_or(true, |s| s.fingerprint != rt.fingerprint)
                })
                .map(|(k, _)| k.clone())
                .collect();
            let mut all = true;
            for key in keys {
                all &= !matches!(rt.membership.ask(AdminRequest::Delete { key }).await, AdminResponse::Error(_));
            }
            stale_speeds = !all;
        }
        if let Some(state) = &v.state {
            let key = Offer::key(&rt.me);
            let current = state.entries.get(&key).and_then(|v| serde_json::from_value::<Offer>(v.clone()).ok());
            let mine = Offer { memory_bytes: rt.offer_bytes, gpus: rt.gpus.clone() };
            if current.as_ref() != Some(&mine) && v.leader.is_some() {
                let value = serde_json::json!(mine);
                if let AdminResponse::Error(e) = rt.membership.ask(AdminRequest::Put { key, value }).await {
                    tracing::info!("publishing this node's memory offer: {e} (retrying)");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
        }
        if view.changed().await.is_err() {
            return;
        }
    }
}

/// The stage this node should run: (model, placement, index).
fn wanted(rt: &Runtime, view: &View) -> Option<(CatalogEntry, ModelPlacement, usize)> {
    let catalog = models::entries(view);
    placements(view).into_values().find_map(|p| {
        let i = p.stage_of(rt.me)?;
        let entry = catalog.iter().find(|e| e.content_hash == p.model)?;
        p.is_valid(entry.n_layer).then(|| (entry.clone(), p, i))
    })
}

/// On every node: run the stage the committed placements give it, and only that one.
pub async fn supervise(rt: Arc<Runtime>) {
    let mut view = rt.membership.view();
    let mut running: Option<((String, u64), tokio::task::JoinHandle<()>)> = None;
    loop {
        let v = view.borrow_and_update().clone();
        let want = wanted(&rt, &v);
        let key = want.as_ref().map(|(_, p, _)| (p.model.clone(), p.generation));
        if running.as_ref().map(|(k, _)| k) != key.as_ref() {
            if let Some((k, task)) = running.take() {
                tracing::info!(model = %k.0, generation = k.1, "stopping the stage");
                // Dropping the service future stops the stage; its memory goes with it.
                task.abort();
                let _ = task.await;
                *lock(&rt.stage) = None;
            }
            if let (Some((entry, placement, index)), Some(k)) = (want, key) {
                if rt.engine.is_some() {
                    let rt2 = rt.clone();
                    let task = tokio::spawn(async move { run_stage(rt2, entry, placement, index).await });
                    running = Some((k, task));
                }
            }
        }
        if view.changed().await.is_err() {
            if let Some((_, task)) = running {
                task.abort();
            }
            return;
        }
    }
}

/// Obtain, load and serve one stage; the state shows in `Stages` (and failures there).
async fn run_stage(rt: Arc<Runtime>, entry: CatalogEntry, placement: ModelPlacement, index: usize) {
    let stage = &placement.stages[index];
    let mut status = StageStatus {
        model: placement.model.clone(),
        generation: placement.generation,
        layers: stage.layers,
        state: StageState::Fetching { done: 0, of: 0 },
        shard_origin: None,
        shard_bytes_received: 0,
        shard_seconds: 0.0,
        load_seconds: 0.0,
        predicted_bytes: stage.memory_bytes,
        loaded_bytes: None,
        resident_bytes: None,
        gpus: stage.gpus.clone(),
        draft: None,
    };
    *lock(&rt.stage) = Some(status.clone());
    let fail = |rt: &Runtime, mut status: StageStatus, why: String| {
        tracing::warn!(model = %status.model, "the stage could not start: {why}");
        status.state = StageState::Failed(why);
        *lock(&rt.stage) = Some(status);
    };
    let Some(engine) = rt.engine.clone() else { return };
    let source: SourceHash = match entry.content_hash.parse() {
        Ok(s) => s,
        Err(_) => return fail(&rt, status, "the catalog entry's hash is malformed".into()),
    };
    // The shard: cached, cut from this node's own copy, or fetched from a holder.
    let view = rt.view();
    let sources = CatalogSources::of(&rt, &view);
    let holders = holders(&rt, &view, &entry);
    let progress_rt = rt.clone();
    let mut progress = move |p: &shoal_transfer::Progress| {
        if let Some(s) = lock(&progress_rt.stage).as_mut() {
            s.state = StageState::Fetching { done: p.chunks_done, of: p.chunks };
            s.shard_bytes_received = p.data_bytes;
        }
    };
    let started = std::time::Instant::now();
    let obtained = match shoal_transfer::obtain(
        &rt.node,
        &sources,
        &holders,
        source,
        stage.layers,
        &rt.cache,
        &mut progress,
    )
    .await
    {
        Ok(o) => o,
        Err(e) => return fail(&rt, status, format!("getting the shard of layers {}: {e}", stage.layers)),
    };
    status.shard_origin = Some(match obtained.origin {
        shoal_transfer::Origin::Cache => "cache".to_string(),
        shoal_transfer::Origin::Built => "built from this node's copy".to_string(),
        shoal_transfer::Origin::Holder(h) => format!("fetched from {}", &h.to_string()[..12]),
    });
    status.shard_bytes_received = obtained.stats.data_bytes;
    status.shard_seconds = started.elapsed().as_secs_f64();
    status.state = StageState::Loading;
    let loading = std::time::Instant::now();
    *lock(&rt.stage) = Some(status.clone());
    let sizing = StageSizing { context: placement.context, sessions: placement.sessions, chunk: placement.chunk };
    let (path, layers, n_layer) = (obtained.file.path.clone(), stage.layers, entry.n_layer);
    // A stage this node ran before is gone by now (its memory freed), so the growth
    // from here is this stage's.
    rt.rss_before_stage.store(resident_bytes().unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    let loaded = {
        let (engine, gpus) = (engine.clone(), stage.gpus.clone());
        tokio::task::spawn_blocking(move || engine.load(&path, layers, n_layer, sizing, &gpus)).await
    };
    let loaded = match loaded {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return fail(&rt, status, format!("loading the stage: {e}")),
        Err(e) => return fail(&rt, status, format!("loading the stage: {e}")),
    };
    // The first stage coordinates: a draft model of this node's that fits the model
    // drafts for its speculating generations (without one, prompt lookup does).
    // It loads into what the plan left of this node's memory: the reserve kept out of
    // the offer, plus the offer less the stage's predicted memory.
    let drafts = if index == 0 {
        let (engine, path, bytes) = (engine.clone(), obtained.file.path.clone(), entry.size);
        // The offer is RAM: a stage's layers on GPUs take none of it.
        let room = draft_room(rt.offer_bytes, rt.draft_reserve, stage.ram_bytes());
        let loaded = match tokio::task::spawn_blocking(move || engine.drafts(&path, bytes, sizing, room)).await {
            Ok(r) => r,
            Err(e) => Err(e.to_string()),
        };
        match loaded {
            Ok(Some(d)) => {
                status.draft = Some(DraftState::Loaded { file: d.file, bytes: d.bytes, cost: d.source.cost() });
                Some(d.source)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!("the draft model did not load, drafting by prompt lookup: {e}");
                status.draft = Some(DraftState::NotLoaded(e));
                None
            }
        }
    } else {
        None
    };
    status.load_seconds = loading.elapsed().as_secs_f64();
    let memory = loaded.memory();
    status.loaded_bytes = Some(memory.weights + memory.kv + memory.compute);
    // Every stage's address, as this node reaches it.
    let mut stages = Vec::new();
    for s in &placement.stages {
        let addr = loop {
            if let Some(a) = rt.addr_of(&rt.view(), s.node) {
                break a;
            }
            // A member not reached yet: its link comes up within a beat or two.
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        stages.push(StagePlace { node: s.node, addr, layers: s.layers });
    }
    let pipeline = Placement {
        model: obtained.file.path.clone(),
        context: placement.context,
        chunk: placement.chunk,
        sessions: placement.sessions,
        stages,
        clients: Vec::new(),
    };
    let cfg = ServiceConfig {
        placement: pipeline,
        index,
        stage: loaded,
        samplers: engine.samplers(&obtained.file.path),
        dtype: Dtype::F32,
        retry: RetryPolicy::default(),
        // The cluster's setting, where its owner made one; else this node's flag.
        keepalive: match crate::admin::keepalive(&rt.view()) {
            Some(true) => Some(shoal_pipeline::KEEPALIVE_WINDOW),
            Some(false) => None,
            None => rt.keepalive,
        },
        drafts,
        // A member renumbered by DHCP is found again: membership moves it to its new
        // address once it proved its key there, and the links follow.
        addresses: Some({
            let rt = rt.clone();
            Arc::new(move |node| rt.addr_of(&rt.view(), node))
        }),
    };
    status.state = StageState::Running;
    *lock(&rt.stage) = Some(status.clone());
    tracing::info!(model = %entry.name, layers = %layers, "stage running");
    if let Err(e) = shoal_pipeline::serve_on(rt.node.clone(), &rt.router, cfg).await {
        fail(&rt, status, format!("the stage stopped: {e}"));
    }
}

/// The sizing a draft model's reserve is counted at: a default load's context and
/// chunk, one session (`models load` and the API's loads use these).
pub const DRAFT_RESERVE_SIZING: StageSizing =
    StageSizing { context: crate::http::DEFAULT_CONTEXT, sessions: 1, chunk: schedule::CHUNK };

/// The memory a coordinating stage's draft model may take: the reserve kept out of
/// the offer for it, plus what the stage's predicted RAM leaves of the offer.
pub fn draft_room(offer: u64, reserve: u64, stage_predicted: u64) -> u64 {
    reserve.saturating_add(offer.saturating_sub(stage_predicted))
}

/// The stage this node runs as `Stages` reports it: its status, with its resident
/// memory read now.
pub fn stage_report(rt: &Runtime) -> Option<StageStatus> {
    let mut st = lock(&rt.stage).clone()?;
    let before = rt.rss_before_stage.load(std::sync::atomic::Ordering::Relaxed);
    if st.state == StageState::Running && before > 0 {
        st.resident_bytes = resident_bytes().map(|now| now.saturating_sub(before));
    }
    Some(st)
}

/// This process's resident memory (VmRSS), bytes; `None` where `/proc` does not say.
fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The live members other than this node that hold `entry`'s file, as the shard
/// client dials them.
fn holders(rt: &Runtime, view: &View, entry: &CatalogEntry) -> Vec<shoal_transfer::Holder> {
    entry
        .holders
        .keys()
        .filter(|h| **h != rt.me && view.alive.contains(h))
        .filter_map(|h| Some(shoal_transfer::Holder { peer: *h, addr: view.addrs.get(h).copied()? }))
        .collect()
}

/// Measure this node's speed on `model` (content hash) for the leader: obtain a shard
/// of a few layers ([`measured_layers`]), load it as a stage, time a prefill chunk and
/// decode steps ([`time_stage`]), drop the shard again if it was fetched for this,
/// and publish the result as `speed/<node>/<model>`.
pub async fn measure(rt: &Arc<Runtime>, model: &str) -> Result<shoal_types::Speed, ApiError> {
    let unavailable = |m: String| ApiError::new(ErrorKind::Unavailable, m);
    let Some(engine) = rt.engine.clone() else {
        return Err(unavailable("this node runs no stages (no engine)".into()));
    };
    if lock(&rt.stage).as_ref().is_some_and(|s| !matches!(s.state, StageState::Failed(_))) {
        return Err(ApiError::new(ErrorKind::Busy, "this node runs a stage; it is measured while free"));
    }
    // One at a time: two would time each other.
    let _one = rt.measuring.lock().await;
    let view = rt.view();
    if let Some(known) = typed::<shoal_types::Speed>(&view, shoal_types::Speed::KEY_PREFIX)
        .get(&format!("{}/{model}", rt.me))
        .filter(|s| s.is_sane() && s.fingerprint == rt.fingerprint)
    {
        // Measured while this ask waited its turn (an earlier leader asked too).
        return Ok(known.clone());
    }
    let entry = models::entries(&view)
        .into_iter()
        .find(|e| e.content_hash == model)
        .ok_or_else(|| ApiError::new(ErrorKind::NotFound, format!("no model {model} in the catalog")))?;
    let source: SourceHash = entry.content_hash.parse().map_err(|_| unavailable("a malformed content hash".into()))?;
    let layers = measured_layers(entry.n_layer, entry.layer_period);
    let obtained = shoal_transfer::obtain(
        &rt.node,
        &CatalogSources::of(rt, &view),
        &holders(rt, &view, &entry),
        source,
        layers,
        &rt.cache,
        &mut |_: &shoal_transfer::Progress| {},
    )
    .await
    .map_err(|e| unavailable(format!("getting the shard of layers {layers} to measure: {e}")))?;
    let path = obtained.file.path.clone();
    let n_layer = entry.n_layer;
    let timed = tokio::task::spawn_blocking(move || {
        let mut stage = engine.load(&path, layers, n_layer, MEASURE_SIZING, &[])?;
        time_stage(stage.as_mut(), MEASURE_SIZING.chunk, MEASURE_DECODE_STEPS, MEASURE_ROUNDS)
    })
    .await
    .map_err(|e| unavailable(e.to_string()))
    .and_then(|r| r.map_err(|e| unavailable(format!("timing layers {layers}: {e}"))));
    // A shard fetched only for this is not kept (a stage here may need other layers).
    // One built from this node's copy stays: its shard server hands the same file to
    // the other members being measured.
    if matches!(obtained.origin, shoal_transfer::Origin::Holder(_)) {
        let _ = std::fs::remove_file(&obtained.file.path);
        let _ = std::fs::remove_file(shoal_gguf::manifest_path(&obtained.file.path));
    }
    let (decode_ms, prefill_ms) = timed?;
    let n = f64::from(layers.len().max(1));
    let speed = shoal_types::Speed {
        ms_per_layer: decode_ms / n,
        prefill_ms_per_layer_token: prefill_ms / n / f64::from(MEASURE_SIZING.chunk),
        layers,
        fingerprint: rt.fingerprint.clone(),
    };
    tracing::info!(model = %entry.name, %layers, ms_per_layer = speed.ms_per_layer, "measured");
    let value = serde_json::to_value(&speed).map_err(|e| unavailable(e.to_string()))?;
    match rt.membership.ask(AdminRequest::Put { key: shoal_types::Speed::key(&rt.me, model), value }).await {
        AdminResponse::Error(e) => Err(unavailable(format!("publishing the measurement: {e}"))),
        _ => Ok(speed),
    }
}

/// How a measured stage is sized: one session, one prefill chunk of context to spare.
const MEASURE_SIZING: StageSizing = StageSizing { context: 256, sessions: 1, chunk: 64 };

/// Decode steps timed by each round of a measurement (the fastest of all counts).
const MEASURE_DECODE_STEPS: u32 = 32;

/// Rounds of a measurement, and the pause between them: what else runs on the machine
/// (a browser, another program, on a shared test machine the other nodes) comes in
/// bursts, and a burst must cover every round to spoil the figure. A member that joins
/// while others generate is measured then; one contiguous round of 32 short steps on
/// a loaded two-core machine could all fall in one burst and make a faster machine
/// look like the others (it then never won a re-plan).
const MEASURE_ROUNDS: u32 = 4;
const MEASURE_PAUSE: Duration = Duration::from_millis(250);

/// The layers a measurement times: at least two middle blocks, on the model's layer
/// period (stage boundaries must fall on it: Gemma 3's is 6), so a shard without
/// embedding or LM head, small enough for any member to fetch and hold; or the whole
/// model when it is too short for that.
pub fn measured_layers(n_layer: u32, period: u32) -> LayerRange {
    let p = period.max(1);
    let width = p * 2u32.div_ceil(p);
    if n_layer > p + width {
        LayerRange::new(p, p + width)
    } else {
        LayerRange::new(0, n_layer)
    }
}

/// Time `stage` in `rounds` spaced by [`MEASURE_PAUSE`]: each round runs a prefill
/// chunk of `chunk` positions (the stage's contract lets a chunk re-run: a replay
/// drops the positions after it), then `steps` one-position decode steps; a warm-up
/// chunk and two warm-up steps come first. Returns (fastest decode step, fastest
/// prefill chunk) in ms: what else runs on the machine only ever adds time, so the
/// minimum is the machine's own speed (the median would carry a browser's or another
/// process's burst into the plan). Inputs are a fixed pattern: the matrix work's time
/// does not depend on values.
fn time_stage(stage: &mut dyn Stage, chunk: u32, steps: u32, rounds: u32) -> Result<(f64, f64), String> {
    let info = stage.info().clone();
    let session = shoal_types::SessionId(0);
    let tokens = |n: u32, pos: u32| -> Vec<shoal_types::TokenId> {
        (0..n).map(|i| ((pos + i) % info.n_vocab.max(1)) as shoal_types::TokenId).collect()
    };
    let hidden = |n: u32, pos: u32| -> Vec<f32> {
        (0..n * info.n_embd).map(|i| (((pos * info.n_embd + i) % 97) as f32 - 48.0) / 480.0).collect()
    };
    let mut run = |pos: u32, n: u32| -> Result<f64, String> {
        let (t, h) = (tokens(n, pos), hidden(n, pos));
        let input = if info.layers.start == 0 {
            shoal_types::StageInput::Tokens(&t)
        } else {
            shoal_types::StageInput::Hidden(&h)
        };
        let t0 = std::time::Instant::now();
        stage.forward(session, pos, input).map_err(|e| e.to_string())?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    run(0, chunk)?;
    run(chunk, 1)?;
    run(chunk + 1, 1)?;
    let (mut decode, mut prefill) = (f64::INFINITY, f64::INFINITY);
    for round in 0..rounds {
        if round > 0 {
            std::thread::sleep(MEASURE_PAUSE);
        }
        prefill = prefill.min(run(0, chunk)?);
        for i in 0..steps {
            decode = decode.min(run(chunk + i, 1)?);
        }
    }
    stage.free_session(session);
    Ok((decode, prefill))
}

/// The models this node holds, for the shard server and local shard builds: a copy is
/// offered only while its size and time are those it was added with (a file changed
/// since is refused, never served).
struct CatalogSources {
    paths: BTreeMap<String, PathBuf>,
}

impl CatalogSources {
    fn of(rt: &Runtime, view: &View) -> CatalogSources {
        let paths = models::entries(view)
            .into_iter()
            .filter_map(|e| {
                let holder = e.holders.get(&rt.me)?;
                let meta = std::fs::metadata(&holder.path).ok()?;
                let same = meta.len() == holder.size && shoal_catalog::mtime_ns(&meta) == holder.mtime_ns;
                if !same {
                    tracing::warn!(model = %e.name, path = %holder.path, "the file changed since it was added; not used");
                    return None;
                }
                Some((e.content_hash, PathBuf::from(&holder.path)))
            })
            .collect();
        CatalogSources { paths }
    }
}

impl shoal_transfer::Sources for CatalogSources {
    fn model_path(&self, source: &SourceHash) -> Option<PathBuf> {
        self.paths.get(&source.to_hex()).cloned()
    }
}

/// The shard server's view of what this node holds, refreshed from membership.
pub struct LiveSources {
    rt: Arc<Runtime>,
}

impl LiveSources {
    /// Sources that follow the catalog as it changes.
    pub fn new(rt: Arc<Runtime>) -> LiveSources {
        LiveSources { rt }
    }
}

impl shoal_transfer::Sources for LiveSources {
    fn model_path(&self, source: &SourceHash) -> Option<PathBuf> {
        CatalogSources::of(&self.rt, &self.rt.view()).model_path(source)
    }

    /// The ranges the cluster runs: a committed placement's stages, the measurement's
    /// (`measured_layers`), the whole model.
    fn cuts(&self, source: &SourceHash, layers: LayerRange) -> bool {
        let view = self.rt.view();
        let hash = source.to_hex();
        let Some(entry) = models::entries(&view).into_iter().find(|e| e.content_hash == hash) else { return false };
        layers == LayerRange::new(0, entry.n_layer)
            || layers == measured_layers(entry.n_layer, entry.layer_period)
            || placements(&view).get(&hash).is_some_and(|p| p.stages.iter().any(|s| s.layers == layers))
    }
}

/// How long a generation waits for the cluster to serve its model again after an
/// interruption (a stage's node lost, the model re-placed) before it fails.
pub const RESUME_WINDOW: Duration = Duration::from_secs(90);

/// Run `request` on `model`'s coordinator, passing each token to `on_token`. When the
/// generation is cut (a stage's node dies, the leader re-places the model, the
/// coordinator goes), it is resumed on the placement that follows, with the tokens made
/// so far replayed in their original shapes: the client sees a pause, and the answer
/// of an uninterrupted run. This node keeps the prompt and the tokens, so the
/// generation survives any node but this one.
pub async fn generate(
    rt: &Runtime,
    model: &str,
    request: &GenerateRequest,
    mut on_token: impl FnMut(shoal_types::TokenId, Option<shoal_types::TokenLogprobs>),
) -> Result<Report, ApiError> {
    let mut view_rx = rt.membership.view();
    let hash = {
        let view = view_rx.borrow().clone();
        let catalog = models::entries(&view);
        models::find(&catalog, model)?.content_hash.clone()
    };
    // Tagged once: each resumption ends what is left of the attempt before it.
    let tag = request.tag.unwrap_or_else(|| {
        let mut b = [0u8; 8];
        // Without randomness the tag is the clock's: any value works, the coordinator
        // matches tags of this node's generations only.
        getrandom::getrandom(&mut b).map_or_else(
            |_| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
            |()| u64::from_le_bytes(b),
        )
    });
    let request = &GenerateRequest { tag: Some(tag), ..request.clone() };
    let mut made = request.resume.clone();
    let mut progress_at = tokio::time::Instant::now();
    let mut checked = false;
    let mut last_reason = String::new();
    loop {
        if made.len() > request.resume.len() && request.finished_by(&made) {
            // Every token was made and passed on; the fault took only the report (it
            // came between the last token and the end). The client has its answer; the
            // logits digest of the steps is not known here (the API does not show it).
            tracing::info!(made = made.len(), "the generation had ended when it was cut; not resumed");
            return Ok(Report { tokens: made, ..Report::default() });
        }
        let view = view_rx.borrow_and_update().clone();
        let name = models::entries(&view).into_iter().find(|e| e.content_hash == hash).map(|e| e.name);
        let Some(name) = name else {
            return Err(ApiError::new(ErrorKind::NotFound, "the model was removed from the catalog"));
        };
        let Some(p) = placements(&view).remove(&hash) else {
            return Err(ApiError::new(ErrorKind::Unavailable, format!("{name} is not loaded (shoal models load)")));
        };
        let interrupted = made.len() > request.resume.len();
        let attempt = match (&p.error, p.stages.first(), p.stages.first().and_then(|s| rt.addr_of(&view, s.node))) {
            (None, Some(_), Some(_)) if !stages_ready(rt, &view, &p).await => {
                // A new placement's stages are still fetching or loading: frames sent
                // now would be lost and wait out a re-drive timeout.
                "the placement's stages are starting".to_string()
            }
            (None, Some(first), Some(addr)) => {
                if !checked {
                    // Refusals (bad parameters, a prompt over the context) come back now,
                    // never as a retry.
                    request.validate(p.context).map_err(|e| ApiError::new(ErrorKind::BadRequest, e))?;
                    checked = true;
                }
                let place = StagePlace { node: first.node, addr, layers: first.layers };
                let req = GenerateRequest { resume: made.clone(), ..request.clone() };
                let run = shoal_pipeline::generate(&rt.node, &place, &req, |t, lp| {
                    made.push(t);
                    progress_at = tokio::time::Instant::now();
                    on_token(t, lp);
                });
                // A new placement replaces every stage of this one: stop waiting on it
                // at once. (A coordinator that died would otherwise be noticed only when
                // QUIC's idle timeout closes the stream, seconds after the leader
                // re-placed the model.)
                let r = tokio::select! {
                    r = run => r,
                    why = replaced(rt, &mut view_rx, &hash, p.generation, first.node, addr) => Err(why),
                };
                match r {
                    Ok(report) => return Ok(report),
                    // A full queue is an answer, not a fault to ride out.
                    Err(shoal_pipeline::PipelineError::Busy(why)) if !interrupted => {
                        return Err(ApiError::new(ErrorKind::Busy, format!("{name}: {why}")));
                    }
                    Err(e) => e.to_string(),
                }
            }
            // The model was placed when the request came (the API waits for that);
            // a member that went away since (WiFi, a lid) may be back in seconds and the
            // leader places it again then: wait, as for an interrupted generation, up
            // to the same bound, instead of refusing the request at once.
            (Some(e), _, _) => format!("it cannot be placed now: {e}"),
            _ => "the coordinator's address is not known yet".to_string(),
        };
        if progress_at.elapsed() > RESUME_WINDOW {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                format!("{name}: no progress for {} s: {attempt}", RESUME_WINDOW.as_secs()),
            ));
        }
        // Said once per reason, not at every short wait below.
        if attempt != last_reason {
            tracing::info!(model = %name, made = made.len(), "generation interrupted ({attempt}); resuming");
        }
        last_reason = attempt;
        // The next placement, or a moment for the stages of this one to come up (their
        // readiness is asked, not pushed: a short wait, as every 100 ms here is 100 ms
        // more of the client's pause).
        let _ = tokio::time::timeout(Duration::from_millis(150), view_rx.changed()).await;
    }
}

/// Completes, saying why, when the committed placement of `model` is no longer
/// `generation` (a new one, or none), or when its coordinator `node` is no longer at
/// `addr` (its machine was renumbered: the stream to the old address would end only
/// at QUIC's idle timeout). Never completes once the view is gone (the node is
/// stopping).
async fn replaced(
    rt: &Runtime,
    view_rx: &mut watch::Receiver<View>,
    model: &str,
    generation: u64,
    node: NodeId,
    addr: SocketAddr,
) -> shoal_pipeline::PipelineError {
    loop {
        if view_rx.changed().await.is_err() {
            return std::future::pending().await;
        }
        let view = view_rx.borrow_and_update().clone();
        let now = placements(&view).remove(model).map(|p| p.generation);
        if now != Some(generation) {
            return shoal_pipeline::PipelineError::Stream("the model was re-placed".into());
        }
        if rt.addr_of(&view, node).is_some_and(|a| a != addr) {
            return shoal_pipeline::PipelineError::Stream("the coordinator moved to a new address".into());
        }
    }
}

/// Whether every stage of `p` runs (asking each stage's node over the node protocol,
/// as a fellow member, all at once; this node's own stage directly). A stage on a
/// member this node sees down is not running: it is not asked (each ask may wait 2 s,
/// and the admin page and `/v1/models` ask often).
pub(crate) async fn stages_ready(rt: &Runtime, view: &View, p: &ModelPlacement) -> bool {
    if p.stages.iter().any(|s| s.node != rt.me && !view.alive.contains(&s.node)) {
        return false;
    }
    let asks = p.stages.iter().map(|s| async move {
        let status = if s.node == rt.me {
            lock(&rt.stage).clone()
        } else {
            let addr = view.addrs.get(&s.node).copied()?;
            let ask = async {
                let conn = rt.node.connect(addr, s.node, shoal_net::alpn::NODE).await.ok()?;
                let (mut send, mut recv) = conn.open_bi().await.ok()?;
                shoal_membership::wire::write_msg(&mut send, &crate::api::NodeRequest::Stages).await.ok()?;
                let _ = send.finish();
                let answer = shoal_membership::wire::read_msg::<NodeResponse>(&mut recv).await.ok()??;
                conn.close(0u32.into(), b"done");
                match answer {
                    NodeResponse::Stages(st) => st.into_iter().next(),
                    _ => None,
                }
            };
            tokio::time::timeout(Duration::from_secs(2), ask).await.ok().flatten()
        };
        status.filter(|st| st.model == p.model && st.generation == p.generation && st.state == StageState::Running)
    });
    futures_util::future::join_all(asks).await.iter().all(Option::is_some)
}

/// The placement of `model`: committed, or what the scheduler would do now.
pub fn plan_of(rt: &Runtime, model: &str) -> Result<NodeResponse, ApiError> {
    let view = rt.view();
    let catalog = models::entries(&view);
    let entry = models::find(&catalog, model)?.clone();
    if let Some(p) = placements(&view).remove(&entry.content_hash) {
        return Ok(NodeResponse::Placement { entry, placement: p, committed: true });
    }
    let mut i = inputs(&view);
    let load = LoadSpec {
        model: entry.content_hash.clone(),
        context: 4096.min(entry.context_length.max(1)),
        sessions: 1,
        exclude: vec![],
    };
    i.loads = vec![load];
    i.placements.clear();
    match schedule::schedule(&i).into_iter().next() {
        Some(Decision::Place(p)) => Ok(NodeResponse::Placement { entry, placement: p, committed: false }),
        _ => Err(ApiError::new(ErrorKind::Unavailable, "the scheduler proposed nothing")),
    }
}

/// The members `prefixes` name (each 8+ hex digits of one member's id).
fn member_ids(view: &View, prefixes: &[String]) -> Result<Vec<NodeId>, ApiError> {
    let members: Vec<NodeId> = view.state.as_ref().map(|s| s.members.keys().copied().collect()).unwrap_or_default();
    let mut ids = Vec::new();
    for x in prefixes {
        let found: Vec<&NodeId> =
            members.iter().filter(|m| m.to_string().starts_with(&x.to_ascii_lowercase())).collect();
        match found.as_slice() {
            [one] if x.len() >= 8 => ids.push(**one),
            _ => {
                return Err(ApiError::new(
                    ErrorKind::BadRequest,
                    format!("{x:?} names no single member (give 8+ hex digits of its id)"),
                ))
            }
        }
    }
    Ok(ids)
}

/// What the planner would do with `model` loaded at `context` positions, keeping off
/// the members `exclude` names, the other loaded models staying where they are: as
/// the leader would, a placement that still fits the new sizing is kept, one that
/// lost a member is repaired. Nothing is committed: the admin page's what-if. (For a
/// model never placed, the leader first has members time it; this uses the speeds
/// measured so far.)
pub fn what_if(rt: &Runtime, model: &str, context: u32, exclude: &[String]) -> Result<ModelPlacement, ApiError> {
    let view = rt.view();
    let catalog = models::entries(&view);
    let entry = models::find(&catalog, model)?.clone();
    if context < 16 {
        return Err(ApiError::new(ErrorKind::BadRequest, "context must be at least 16"));
    }
    let exclude = member_ids(&view, exclude)?;
    let hash = entry.content_hash.clone();
    let mut i = inputs(&view);
    let sessions = i.loads.iter().find(|l| l.model == hash).map_or(1, |l| l.sessions);
    i.loads.retain(|l| l.model != hash);
    i.loads.push(LoadSpec { model: hash.clone(), context, sessions, exclude });
    let kept = i.placements.get(&hash).cloned();
    schedule::schedule(&i)
        .into_iter()
        .find_map(|d| match d {
            Decision::Place(p) if p.model == hash => Some(p),
            _ => None,
        })
        // No change proposed: the placement it has stays.
        .or(kept)
        .ok_or_else(|| ApiError::new(ErrorKind::Unavailable, "the planner proposed nothing"))
}

/// Keep `model` loaded with this sizing.
pub async fn load(
    rt: &Runtime,
    model: &str,
    context: u32,
    sessions: u32,
    exclude: &[String],
) -> Result<String, ApiError> {
    let view = rt.view();
    let catalog = models::entries(&view);
    let entry = models::find(&catalog, model)?;
    if context == 0 || sessions == 0 || context < 16 {
        return Err(ApiError::new(ErrorKind::BadRequest, "context must be at least 16 and sessions at least 1"));
    }
    let ids = member_ids(&view, exclude)?;
    if !view.state.as_ref().is_some_and(|s| s.entries.contains_key(&format!("{PROFILE_PREFIX}{}", entry.content_hash)))
    {
        return Err(ApiError::new(ErrorKind::Unavailable, "the model's description is missing; add it again"));
    }
    let spec = LoadSpec { model: entry.content_hash.clone(), context, sessions, exclude: ids };
    let value = serde_json::to_value(&spec).map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
    match rt.membership.ask(AdminRequest::Put { key: spec.key(), value }).await {
        AdminResponse::Ok(_) => {
            Ok(format!("{} loading: the leader places it (see `shoal models plan {}`)", entry.name, entry.name))
        }
        AdminResponse::Error(e) => Err(ApiError::new(ErrorKind::Unavailable, e)),
        other => Err(ApiError::new(ErrorKind::Unavailable, format!("{other:?}"))),
    }
}

/// Stop running `model`.
pub async fn unload(rt: &Runtime, model: &str) -> Result<String, ApiError> {
    let view = rt.view();
    let catalog = models::entries(&view);
    let entry = models::find(&catalog, model)?;
    match rt
        .membership
        .ask(AdminRequest::Delete { key: format!("{}{}", LoadSpec::KEY_PREFIX, entry.content_hash) })
        .await
    {
        AdminResponse::Ok(_) => Ok(format!("{} unloading: its stages stop and free their memory", entry.name)),
        AdminResponse::Error(e) => Err(ApiError::new(ErrorKind::Unavailable, e)),
        other => Err(ApiError::new(ErrorKind::Unavailable, format!("{other:?}"))),
    }
}

/// The planner profile of the model at `path`, for `model-profile/<hash>`.
pub fn profile_of(path: &Path) -> Option<ModelProfile> {
    let (_, meta) = shoal_gguf::open_model(path).ok()?;
    Some(ModelProfile::from_meta(&meta))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a holder panicked between plain field updates.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Watch a view (re-exported for tests).
pub type ViewRx = watch::Receiver<View>;
