//! What the admin page shows, as the node fills it in and the page reads it (JSON):
//! plain data, no behaviour.

use serde::{Deserialize, Serialize};

/// The pool as one node sees it: its members, the nodes waiting, the models.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Overview {
    /// The cluster's id (hex), or empty while this node is in none.
    pub cluster: String,
    /// The name its owner gave it (empty: none yet).
    pub name: String,
    /// The node that answered (its id).
    pub node: String,
    /// The members, the leader first.
    pub nodes: Vec<NodeCard>,
    /// Nodes seen on the LAN that wait to be let in.
    pub pending: Vec<PendingNode>,
    /// The catalog, with what each loaded model takes.
    pub models: Vec<ModelCard>,
    /// What happened lately, as the answering node saw it, oldest first.
    pub events: Vec<LogEvent>,
    /// The API keys (names and dates; secrets are never kept).
    pub keys: Vec<KeyRow>,
    /// Downloads started from the page on the answering node, newest last.
    pub downloads: Vec<Download>,
    /// Counters for the activity charts.
    pub activity: Activity,
    /// The cluster-wide settings.
    pub settings: Settings,
}

/// Settings every node follows, kept in the cluster state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Every machine may call the API without a key (else: keys for other machines).
    pub api_open: bool,
    /// Stages spin between tokens: "on", "off", or "node" (each node's own flag).
    pub keepalive: String,
}

/// What the activity charts are drawn from: the answering node's API counters (the
/// page turns successive ones into rates) and the stages' hop latencies.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    /// When these were read, Unix milliseconds.
    pub at_ms: u64,
    /// Tokens this node's API streamed since it started.
    pub streamed_tokens: u64,
    /// Requests this node's API answered.
    pub requests: u64,
    /// Of which refused or failed (status 400 or more).
    pub failed_requests: u64,
    /// Generations streaming through this node's API now.
    pub in_flight: u64,
    /// Frame latency into each running stage, by frame size, as the stages measure it.
    pub hops: Vec<Hop>,
}

/// Latency of the frames reaching one stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Hop {
    /// The model's name.
    pub model: String,
    /// The node that runs the stage (id).
    pub node: String,
    /// Its layers, first and one past the last.
    pub first: u32,
    /// See `first`.
    pub end: u32,
    /// Which frames, e.g. "hidden <= 4 KiB".
    pub class: String,
    /// Frames recorded.
    pub frames: u64,
    /// Median, microseconds.
    pub p50_us: u64,
    /// 99th percentile, microseconds.
    pub p99_us: u64,
    /// Replays the stage made (a restarted or replaced stage catches up).
    pub replays: u64,
    /// Times its link to the next stage was (re)connected.
    pub link_connects: u64,
}

/// One API key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyRow {
    /// Its name.
    pub name: String,
    /// When it was made, Unix seconds.
    pub created_unix: u64,
}

/// A model download the page started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Download {
    /// The URL or `hf://` name.
    pub source: String,
    /// Bytes so far.
    pub done: u64,
    /// Bytes in all, when the server said.
    pub total: Option<u64>,
    /// "running", "added" or "failed".
    pub state: String,
    /// The catalog name once added, or why it failed.
    pub message: String,
}

/// One event of the answering node's log.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogEvent {
    /// When, Unix milliseconds.
    pub at_ms: u64,
    /// Kind: `join`, `leave`, `down`, `up`, `leader`, `placed`, `replaced`, `unplaced`,
    /// `unloaded`, `owner` (an owner's action, with the member it came through).
    pub kind: String,
    /// For people.
    pub text: String,
}

/// One member.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeCard {
    /// Its key (hex).
    pub id: String,
    /// Its name (host name at approval).
    pub name: String,
    /// "hub" or "pc".
    pub role: String,
    /// "online", "suspected" or "down", as the answering node sees it.
    pub state: String,
    /// Whether it leads.
    pub leader: bool,
    /// Where it was last reached.
    pub addr: Option<String>,
    /// What the machine reported of itself, when it answered (a node that is down, or
    /// an older version, does not).
    pub machine: Option<Machine>,
    /// Memory it offers to models, bytes (RAM and VRAM).
    pub offered_bytes: Option<u64>,
    /// Memory the stages placed on it take, bytes (the planner's prediction).
    pub placed_bytes: u64,
}

/// A machine's own report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Shoal's version.
    pub version: String,
    /// Operating system.
    pub os: String,
    /// CPU model.
    pub cpu: String,
    /// Logical cores.
    pub cores: u32,
    /// CPU busy over every core lately, percent (absent: not measured yet).
    pub cpu_percent: Option<f32>,
    /// RAM installed, bytes.
    pub ram_total: u64,
    /// RAM available now, bytes.
    pub ram_available: u64,
    /// GPUs.
    pub gpus: Vec<Gpu>,
}

/// One GPU of a machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// For people, e.g. "NVIDIA GeForce RTX 4070".
    pub name: String,
    /// VRAM, bytes.
    pub total: u64,
    /// VRAM free, bytes.
    pub free: u64,
}

/// A node waiting to be let in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingNode {
    /// Its key (hex): the fingerprint its owner can compare.
    pub id: String,
    /// Its name.
    pub name: String,
    /// "hub" or "pc".
    pub role: String,
    /// Memory it offers, bytes.
    pub memory_bytes: u64,
    /// Where it answered.
    pub addr: String,
}

/// One model of the catalog.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name.
    pub name: String,
    /// Its content hash.
    pub hash: String,
    /// File size, bytes.
    pub size: u64,
    /// Architecture, e.g. "llama".
    pub arch: String,
    /// Layers.
    pub layers: u32,
    /// "available" (not loaded), "loading", "ready" or "unplaced".
    pub state: String,
    /// Why it is not placed, when unplaced.
    pub error: Option<String>,
    /// Its stages in chain order, when placed.
    pub stages: Vec<StageCard>,
    /// The planner's prediction of one session's decode speed, tokens/s.
    pub predicted_tok_s: Option<f64>,
    /// The planner's reasons.
    pub explanation: Vec<String>,
    /// The decode speed of the last generation of it through the answering node's
    /// API, tokens/s.
    pub measured_tok_s: Option<f64>,
}

/// One stage of a placed model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageCard {
    /// The node that runs it (id).
    pub node: String,
    /// Its layers, e.g. "0-12" (first inclusive, end exclusive).
    pub layers: String,
    /// First layer.
    pub first: u32,
    /// One past its last layer.
    pub end: u32,
    /// Memory the planner predicts, bytes.
    pub memory_bytes: u64,
    /// The stage's state on its node ("fetching", "loading", "running", …), when it
    /// reported.
    pub state: Option<String>,
    /// Memory llama.cpp's buffers hold once loaded, bytes (measured on the node).
    pub loaded_bytes: Option<u64>,
    /// The node process's resident memory growth since the stage loaded, bytes.
    pub resident_bytes: Option<u64>,
    /// Its measured compute per decode step, milliseconds (once it decoded).
    pub decode_ms: Option<f64>,
    /// Stage 0's draft model in words ("drafts with small.gguf, 0.4 GiB", or why its
    /// node's did not load); `None` where it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<String>,
}
