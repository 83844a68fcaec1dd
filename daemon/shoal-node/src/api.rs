//! The node protocol (ALPN `shoal/node/1`): what the owner's CLI (holding the node's own
//! key) asks the node process, and what members may read. One request per stream, as
//! length-prefixed JSON (the membership wire format); errors are typed so that a client
//! (the CLI now, the HTTP API later) can act on them.

use serde::{Deserialize, Serialize};
use shoal_membership::wire::{read_msg, write_msg};
use shoal_net::{alpn, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use shoal_types::{CatalogEntry, ModelPlacement};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A request to the node process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRequest {
    /// Add the GGUF at `path` (on the node's machine) to the cluster's catalog, used in
    /// place. Adding a file another node already added makes this node a holder too.
    ModelAdd {
        /// Absolute path on the node.
        path: String,
        /// The catalog name (default: the file's name).
        name: Option<String>,
    },
    /// [`NodeRequest::ModelAdd`], with the hashing's progress streamed as
    /// [`NodeResponse::Progress`] before the answer (`shoal models add` draws it: a
    /// 40 GB file takes minutes to hash).
    ModelAddWatched {
        /// Absolute path on the node.
        path: String,
        /// The catalog name (default: the file's name).
        name: Option<String>,
    },
    /// The catalog, with the state of this node's copies.
    ModelList,
    /// Remove a model from the catalog (by name, or a prefix of its content hash).
    ModelRemove {
        /// Name or hash prefix.
        model: String,
    },
    /// The models found in another program's store on this node's machine.
    ModelScan {
        /// Which store.
        from: StoreKind,
    },
    /// Add models found in another program's store (all of them when `names` is empty).
    ModelImport {
        /// Which store.
        from: StoreKind,
        /// Names as [`NodeRequest::ModelScan`] lists them.
        names: Vec<String>,
    },
    /// Keep a model loaded: the leader places it and the chosen nodes run its stages.
    ModelLoad {
        /// Name or hash prefix.
        model: String,
        /// Positions per session.
        context: u32,
        /// Sessions held at once.
        sessions: u32,
        /// Node ids (or 8+ hex prefixes) the model must not use.
        exclude: Vec<String>,
    },
    /// Stop running a model (every stage frees its memory).
    ModelUnload {
        /// Name or hash prefix.
        model: String,
    },
    /// Where a model is (or would be) placed, with the planner's reasons.
    ModelPlan {
        /// Name or hash prefix.
        model: String,
    },
    /// Run a generation on a loaded model, wherever its coordinator runs. The answer
    /// is a stream: [`NodeResponse::Token`] for each token, then
    /// [`NodeResponse::Generated`] (or an error).
    Generate {
        /// Name or hash prefix.
        model: String,
        /// The request as the coordinator takes it (the client tokenized the prompt).
        request: shoal_pipeline::GenerateRequest,
    },
    /// The stages this node runs, and their state.
    Stages,
    /// Where each loaded model's decode steps spend their time: its stages' shares,
    /// asked of their nodes and added up round the ring (`shoal status`).
    Breakdowns,
    /// What this node's machine has and uses now (the admin page's machine cards).
    Inventory,
    /// Bytes of the header (metadata and tensor table) of a model this node holds, from
    /// `offset` on: a node that holds neither the model nor a shard of it builds a
    /// vocabulary-only file from them (the HTTP API tokenizes with it).
    ModelHeader {
        /// The model's content hash.
        model: String,
        /// Where to start, within the header.
        offset: u64,
    },
    /// Time a few layers of a model on this node and publish its [`shoal_types::Speed`]
    /// (the leader asks free members before it plans the model, so that the plan rests
    /// on measured speeds). Only the leader may ask; one measurement at a time, and not
    /// while this node runs a stage.
    Measure {
        /// The model's content hash.
        model: String,
    },
    /// Probe this node's links to the other members and publish what it measured
    /// (`links/<node>`): the leader asks before it plans, one member at a time. Only the
    /// leader may ask.
    ProbeLinks {
        /// The frame size to time (a decode step's hidden state), bytes.
        frame_bytes: u32,
    },
    /// Make an API key (its secret is in the answer, and nowhere else).
    KeyCreate {
        /// What it is for.
        name: String,
        /// What it may do (a chat client's key by default).
        #[serde(default)]
        scope: shoal_types::KeyScope,
    },
    /// The API keys (names and dates; no secrets).
    KeyList,
    /// Revoke an API key.
    KeyRevoke {
        /// Its name.
        name: String,
    },
}

/// Most header bytes one [`NodeResponse::Header`] carries (JSON makes ~3.6 characters
/// of a byte; the answer must stay under the wire's message bound).
pub const HEADER_CHUNK: u64 = 256 << 10;

/// Largest header a node fetches (a 256k-token vocabulary with its merges takes ~15 MB).
pub const MAX_HEADER: u64 = 64 << 20;

impl NodeRequest {
    /// Whether a member other than the owner may ask this (reading only).
    pub fn member_may(&self) -> bool {
        matches!(
            self,
            NodeRequest::ModelList
                | NodeRequest::ModelPlan { .. }
                | NodeRequest::Stages
                | NodeRequest::Breakdowns
                | NodeRequest::Inventory
                | NodeRequest::ModelHeader { .. }
                // The node checks that the asker leads.
                | NodeRequest::Measure { .. }
                | NodeRequest::ProbeLinks { .. }
        )
    }

    /// How long a client waits for the answer: hashing a 40 GB file takes minutes.
    pub fn patience(&self) -> Duration {
        match self {
            NodeRequest::ModelAdd { .. } | NodeRequest::ModelImport { .. } => Duration::from_secs(3600),
            // Between two progress messages (a few a second while the file is read).
            NodeRequest::ModelAddWatched { .. } => Duration::from_secs(600),
            // Between two tokens (a long prompt's prefill on slow machines included).
            NodeRequest::Generate { .. } => Duration::from_secs(600),
            // A shard of a few layers fetched, loaded and timed.
            NodeRequest::Measure { .. } => Duration::from_secs(300),
            // Each peer's probe is bounded by a minute.
            NodeRequest::ProbeLinks { .. } => Duration::from_secs(600),
            _ => Duration::from_secs(30),
        }
    }
}

/// Another program's model store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Ollama (`~/.ollama/models`, or the Linux service's).
    Ollama,
    /// LM Studio (`~/.lmstudio/models`).
    Lmstudio,
    /// The Hugging Face hub cache (`~/.cache/huggingface/hub`).
    Hf,
}

/// The node's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeResponse {
    /// The entry as it now stands in the catalog.
    Added(CatalogEntry),
    /// The catalog.
    Models(Vec<ModelRow>),
    /// The entry removed.
    Removed(CatalogEntry),
    /// What a store holds.
    Found {
        /// Models that can be added: (name, path).
        found: Vec<(String, String)>,
        /// Files passed over: (path, why).
        skipped: Vec<(String, String)>,
    },
    /// What an import did.
    Imported {
        /// Entries added (or joined as a holder).
        added: Vec<CatalogEntry>,
        /// Models refused: (name, why).
        refused: Vec<(String, String)>,
    },
    /// The placement of a model (committed, or what the planner would do now).
    Placement {
        /// The catalog entry.
        entry: CatalogEntry,
        /// The placement.
        placement: ModelPlacement,
        /// Whether it is committed (false: only a proposal, `models load` commits it).
        committed: bool,
    },
    /// A load or unload was committed; the placement follows (see `models plan`).
    Ok(String),
    /// One generated token.
    Token(shoal_types::TokenId),
    /// How far a streamed request's work has come (hashing a model: bytes read of the
    /// file's), sent before its answer.
    Progress {
        /// Work done.
        done: u64,
        /// Work in all.
        total: u64,
    },
    /// The generation's end.
    Generated(shoal_pipeline::Report),
    /// The stages this node runs.
    Stages(Vec<StageStatus>),
    /// Per loaded model (its name), where its decode steps' time goes; models whose
    /// coordinator timed no step yet, or whose stages did not all answer, are left out.
    Breakdowns(Vec<(String, shoal_pipeline::TokenBreakdown)>),
    /// This node's machine (boxed: much larger than the other answers).
    Inventory(Box<shoal_types::NodeInventory>),
    /// A key was made: its secret, shown once.
    KeyCreated {
        /// The key as stored.
        key: shoal_types::ApiKey,
        /// The secret clients send.
        secret: String,
    },
    /// The API keys.
    Keys(Vec<shoal_types::ApiKey>),
    /// This node's speed on a model, as [`NodeRequest::Measure`] timed and published it.
    Measured(shoal_types::Speed),
    /// Part of a model's header.
    Header {
        /// Where the data section starts: the header's length.
        data_offset: u64,
        /// The whole file's size.
        file_size: u64,
        /// Up to [`HEADER_CHUNK`] bytes from the asked offset.
        bytes: Vec<u8>,
    },
    /// The request failed.
    Error(ApiError),
}

/// One stage a node runs (or is preparing).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageStatus {
    /// The model's content hash.
    pub model: String,
    /// The placement generation it serves.
    pub generation: u64,
    /// Its layers.
    pub layers: shoal_types::LayerRange,
    /// Where it stands.
    pub state: StageState,
    /// How the shard came: from the cache, built from a local copy, or from a holder.
    pub shard_origin: Option<String>,
    /// Bytes of shard data received over the network.
    pub shard_bytes_received: u64,
    /// Seconds it took to have the shard (cache check, local cut or transfer).
    #[serde(default)]
    pub shard_seconds: f64,
    /// Seconds it took to load the shard into the engine.
    #[serde(default)]
    pub load_seconds: f64,
    /// Memory the planner predicted for it, bytes.
    pub predicted_bytes: u64,
    /// Memory it holds once loaded (llama.cpp's buffers), bytes.
    pub loaded_bytes: Option<u64>,
    /// How much this node's resident memory (RSS) grew from just before the stage
    /// loaded to when this status was asked, bytes: what the stage (and stage 0's
    /// draft model, loaded after it) really holds in RAM, mapped weights counted once
    /// paged in (after the first generations). `None`
    /// before it runs, or where the system does not say (only Linux's `/proc` is read).
    #[serde(default)]
    pub resident_bytes: Option<u64>,
    /// Its layers on GPUs, as the placement says (empty: all on the CPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<shoal_types::GpuShare>,
    /// The draft model a coordinating stage (stage 0) drafts with, or why its node's
    /// did not load; `None`: the node has none for this model (prompt lookup drafts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftState>,
}

/// A coordinating stage's draft model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftState {
    /// Loaded: speculating generations draft with it.
    Loaded {
        /// Its file's name.
        file: String,
        /// What it holds (weights, KV cache, compute buffers), bytes.
        bytes: u64,
        /// What a drafted token costs, thousandths of a target pass.
        cost: u32,
    },
    /// The node has one for this model's vocabulary, but it did not fit or load (why);
    /// prompt lookup drafts instead.
    NotLoaded(String),
}

impl DraftState {
    /// In words for `shoal status` and `shoal models plan`, its memory as `size` writes
    /// bytes.
    pub fn describe(&self, size: impl Fn(u64) -> String) -> String {
        match self {
            DraftState::Loaded { file, bytes, cost } => {
                format!("drafting with {file} ({}, a drafted token ~{cost}‰ of a pass)", size(*bytes))
            }
            DraftState::NotLoaded(why) => format!("its draft model not loaded: {why}"),
        }
    }
}

/// A stage's progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageState {
    /// Getting its shard (chunks done of all).
    Fetching {
        /// Chunks received and verified.
        done: u64,
        /// Chunks in all.
        of: u64,
    },
    /// Loading the shard into the engine.
    Loading,
    /// Serving.
    Running,
    /// It could not start.
    Failed(String),
}

/// One catalog entry as a node lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelRow {
    /// The entry.
    pub entry: CatalogEntry,
    /// This node's copy, if it holds one.
    pub here: Option<CopyState>,
    /// Where it runs, when it is loaded.
    #[serde(default)]
    pub placement: Option<ModelPlacement>,
}

/// How this node's copy of a model looks (a quick size and time check; the full hash
/// check runs before the file is used).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyState {
    /// Same size and time as when added.
    Unchanged,
    /// Another size or time: it will be re-hashed, and refused if its bytes changed.
    Changed,
    /// The file is gone or unreadable.
    Missing,
}

/// A failed request: what kind of failure (for a status code), and what to tell people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The kind.
    pub kind: ErrorKind,
    /// For people.
    pub message: String,
}

/// Kinds of failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is malformed or names nothing sensible.
    BadRequest,
    /// Only the node's owner may ask that.
    Forbidden,
    /// No such model.
    NotFound,
    /// It clashes with what exists (a name taken by another model).
    Conflict,
    /// The file is not one Shoal can serve (not GGUF, truncated, unsupported).
    Refused,
    /// The cluster cannot do it now (no leader, not a member yet).
    Unavailable,
    /// The model runs every session it holds and its queue is full: try again later.
    Busy,
}

impl ApiError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into() }
    }
}

/// Why a client request failed before an answer came.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The node's address file is missing or unreadable.
    #[error("{path}: {source} (is `shoal serve` running with this data directory?)")]
    NoNode {
        /// The address file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The node did not answer.
    #[error("the node at {addr} does not answer: {why}")]
    Down {
        /// Where it was asked.
        addr: SocketAddr,
        /// Why.
        why: String,
    },
}

/// Ask the node whose data directory is `data_dir` (on this machine), as its owner.
pub async fn request(data_dir: &Path, identity: Arc<Identity>, req: &NodeRequest) -> Result<NodeResponse, ClientError> {
    let addr = endpoint_of(data_dir)?;
    let me = identity.id();
    request_at(addr, me, identity, req).await
}

/// [`request`] for an answer that is a stream ([`NodeRequest::Generate`],
/// [`NodeRequest::ModelAddWatched`]): every
/// message goes to `on_message` until a final one, which is returned.
pub async fn request_stream(
    data_dir: &Path,
    identity: Arc<Identity>,
    req: &NodeRequest,
    on_message: &mut (dyn FnMut(&NodeResponse) + Send),
) -> Result<NodeResponse, ClientError> {
    let addr = endpoint_of(data_dir)?;
    let node = identity.id();
    exchange(addr, node, identity, req, on_message).await
}

/// One request to node `node` at `addr`: streamed [`NodeResponse::Token`]s and
/// [`NodeResponse::Progress`]es go to `on_message`; the first other message is the answer.
async fn exchange(
    addr: SocketAddr,
    node: NodeId,
    identity: Arc<Identity>,
    req: &NodeRequest,
    on_message: &mut (dyn FnMut(&NodeResponse) + Send),
) -> Result<NodeResponse, ClientError> {
    let down = |why: String| ClientError::Down { addr, why };
    let client = client_for(addr, node, identity).map_err(|e| down(e.to_string()))?;
    let conn = tokio::time::timeout(Duration::from_secs(5), client.connect(addr, node, alpn::NODE))
        .await
        .map_err(|_| down("no answer within 5 s".into()))?
        .map_err(|e| down(e.to_string()))?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| down(e.to_string()))?;
    write_msg(&mut send, req).await.map_err(|e| down(e.to_string()))?;
    let _ = send.finish();
    let patience = req.patience();
    loop {
        let msg = tokio::time::timeout(patience, read_msg::<NodeResponse>(&mut recv))
            .await
            .map_err(|_| down(format!("no answer within {} s", patience.as_secs())))?
            .map_err(|e| down(e.to_string()))?
            .ok_or_else(|| down("the node closed the stream without answering".into()))?;
        if matches!(msg, NodeResponse::Token(_) | NodeResponse::Progress { .. }) {
            on_message(&msg);
            continue;
        }
        conn.close(0u32.into(), b"done");
        client.close();
        return Ok(msg);
    }
}

/// The local node's address, from its data directory.
fn endpoint_of(data_dir: &Path) -> Result<SocketAddr, ClientError> {
    let path = data_dir.join(shoal_membership::node::ENDPOINT_FILE);
    let no_node = |source| ClientError::NoNode { path: path.display().to_string(), source };
    let text = std::fs::read_to_string(&path).map_err(no_node)?;
    let mut addr: SocketAddr = text
        .trim()
        .parse()
        .map_err(|_| no_node(std::io::Error::new(std::io::ErrorKind::InvalidData, "not an address")))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(if addr.is_ipv4() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
        });
    }
    Ok(addr)
}

/// A client endpoint of `addr`'s family trusting only `node`.
fn client_for(addr: SocketAddr, node: NodeId, identity: Arc<Identity>) -> Result<Node, shoal_net::NetError> {
    let any: SocketAddr = if addr.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    Node::bind(any, identity, TrustedKeys::new([node]), &TransportOptions::default())
}

/// Ask node `node` at `addr`, holding `identity` (its own key: anything; a member's: what
/// [`NodeRequest::member_may`] allows).
pub async fn request_at(
    addr: SocketAddr,
    node: NodeId,
    identity: Arc<Identity>,
    req: &NodeRequest,
) -> Result<NodeResponse, ClientError> {
    exchange(addr, node, identity, req, &mut |_| {}).await
}
