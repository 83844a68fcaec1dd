//! Running models, as the replicated cluster state holds them: what the owner asked to
//! load (`load/<content hash>`), where the leader placed it (`placement/<content
//! hash>`), and how much memory each node offers (`offer/<node id>`). Plain data with
//! typed keys: the leader's scheduler writes placements, every node's supervisor reads
//! them. No I/O here.

use crate::{LayerRange, NodeId};
use serde::{Deserialize, Serialize};

/// "Keep this model loaded": set by `shoal models load`, deleted by `unload`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// The model's content hash (its catalog key's suffix).
    pub model: String,
    /// Positions per session.
    pub context: u32,
    /// Sessions held at once.
    pub sessions: u32,
    /// Nodes the model must not use.
    #[serde(default)]
    pub exclude: Vec<NodeId>,
}

impl LoadSpec {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "load/";

    /// Its key: `load/<content hash>`.
    pub fn key(&self) -> String {
        format!("{}{}", Self::KEY_PREFIX, self.model)
    }
}

/// Where a loaded model runs: the leader's decision, replaced as a whole (with a higher
/// `generation`) when it re-places the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelPlacement {
    /// The model's content hash.
    pub model: String,
    /// Bumped each time the model is placed anew; a stage serves one generation.
    pub generation: u64,
    /// Positions per session.
    pub context: u32,
    /// Sessions held at once.
    pub sessions: u32,
    /// Prefill chunk size C (every stage's micro-batch).
    pub chunk: u32,
    /// The stages in chain order; stage 0's node coordinates. Empty when the model
    /// cannot be placed now (`error` says why).
    pub stages: Vec<PlacedStage>,
    /// The planner's prediction of one session's decode speed.
    pub predicted_tok_s: f64,
    /// Of a predicted token's time (`1000 / predicted_tok_s` ms), the stages' compute,
    /// ms; the rest is hops and protocol. Speculative decoding weighs a step's cost
    /// with it ([`crate::speculative::step_cost_for`]). 0 in placements made before.
    #[serde(default)]
    pub predicted_compute_ms: f64,
    /// Why this placement, in sentences (or why none).
    pub explanation: Vec<String>,
    /// Set when the model cannot be placed on the members available now.
    #[serde(default)]
    pub error: Option<String>,
}

/// One stage of a placement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedStage {
    /// The node that runs it.
    pub node: NodeId,
    /// Its layers.
    pub layers: LayerRange,
    /// The memory the planner predicts it takes, bytes (RAM and VRAM together).
    pub memory_bytes: u64,
    /// Its last `gpu_layers` layers run on the node's GPUs, `gpus` saying how many on
    /// which; the others on the CPU (llama.cpp's `n_gpu_layers` offloads a model's last
    /// layers). Absent in placements of nodes that offer no GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuShare>,
}

/// The layers of a stage that one of its node's GPUs holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShare {
    /// The backend device's name on that node, e.g. "CUDA0" or "Vulkan1".
    pub device: String,
    /// How many of the stage's layers it holds.
    pub layers: u32,
    /// Whether it holds the output norm and LM head too (only the tail's last GPU,
    /// where the planner counted the head).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub head: bool,
    /// The memory the planner predicts it takes on that device, bytes (part of the
    /// stage's `memory_bytes`).
    pub memory_bytes: u64,
}

impl PlacedStage {
    /// Layers offloaded to GPUs (llama.cpp's `n_gpu_layers`, not counting the head).
    pub fn gpu_layers(&self) -> u32 {
        self.gpus.iter().map(|g| g.layers).sum()
    }

    /// The memory the planner predicts it takes in RAM (the rest is on GPUs).
    pub fn ram_bytes(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.gpus.iter().map(|g| g.memory_bytes).sum())
    }
}

impl ModelPlacement {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "placement/";

    /// Its key: `placement/<content hash>`.
    pub fn key(&self) -> String {
        format!("{}{}", Self::KEY_PREFIX, self.model)
    }

    /// The index of `node`'s stage.
    pub fn stage_of(&self, node: NodeId) -> Option<usize> {
        self.stages.iter().position(|s| s.node == node)
    }

    /// Whether the stages cover `n_layer` blocks in order, one stage per node, each
    /// offloading at most its own layers (the head only on the tail's last GPU).
    pub fn is_valid(&self, n_layer: u32) -> bool {
        let mut next = 0;
        for (i, s) in self.stages.iter().enumerate() {
            if s.layers.start != next || s.layers.is_empty() || self.stages[..i].iter().any(|o| o.node == s.node) {
                return false;
            }
            let gpu = s.gpus.iter().try_fold(0u32, |a, g| a.checked_add(g.layers));
            let head = s.gpus.iter().filter(|g| g.head).count();
            let tail = i + 1 == self.stages.len();
            // One share per device: llama.cpp's split gives each device one run of layers.
            let twice = s.gpus.iter().enumerate().any(|(j, g)| s.gpus[..j].iter().any(|o| o.device == g.device));
            if gpu.is_none_or(|g| g > s.layers.len())
                || twice
                || head > 1
                || (head == 1 && !(tail && s.gpus.last().is_some_and(|g| g.head)))
            {
                return false;
            }
            next = s.layers.end;
        }
        !self.stages.is_empty() && next == n_layer && self.chunk > 0 && self.context >= self.chunk && self.sessions > 0
    }
}

/// The memory a node offers to models (`shoal serve --max-memory`, else what it has
/// free when it starts), so the leader plans within it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// RAM, bytes.
    pub memory_bytes: u64,
    /// Its GPUs, each a device the leader may put layers on (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuOffer>,
}

/// One GPU a node offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuOffer {
    /// The backend device's name, e.g. "CUDA0" (what a [`GpuShare`] names).
    pub device: String,
    /// For people, e.g. "NVIDIA GeForce RTX 4070".
    pub description: String,
    /// VRAM offered, bytes (free at start less a reserve for the driver and display).
    pub memory_bytes: u64,
}

impl Offer {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "offer/";

    /// The key of `node`'s offer: `offer/<node id>`.
    pub fn key(node: &NodeId) -> String {
        format!("{}{node}", Self::KEY_PREFIX)
    }
}

/// A member's speed on one model, measured by the member itself on a few of the
/// model's layers when the leader asks (so a member that cannot hold the whole model
/// is measured too): the planner's device speeds for that member and model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Speed {
    /// Decode time of one layer for one token, ms.
    pub ms_per_layer: f64,
    /// Prefill time of one layer per prompt token, ms.
    pub prefill_ms_per_layer_token: f64,
    /// The layers that were timed.
    pub layers: LayerRange,
    /// What the speed depends on besides the machine (the engine's threads and
    /// backends): the member measures again when its own differs.
    #[serde(default)]
    pub fingerprint: String,
}

impl Speed {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "speed/";

    /// The key of `node`'s speed on the model of content hash `model`:
    /// `speed/<node id>/<model>`.
    pub fn key(node: &NodeId, model: &str) -> String {
        format!("{}{node}/{model}", Self::KEY_PREFIX)
    }

    /// Whether the figures can be planned with: finite, positive and below a minute
    /// per layer (an entry is a member's word; a broken one is ignored, not believed).
    pub fn is_sane(&self) -> bool {
        let ok = |v: f64| v.is_finite() && v > 0.0 && v < 60_000.0;
        ok(self.ms_per_layer) && ok(self.prefill_ms_per_layer_token) && !self.layers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nodes 1 and 2 run layers 0-10 and 10-30.
    fn two_stages() -> ModelPlacement {
        ModelPlacement {
            model: "ab".repeat(32),
            generation: 1,
            context: 256,
            sessions: 1,
            chunk: 64,
            stages: vec![stage(1, 0, 10), stage(2, 10, 30)],
            predicted_tok_s: 1.0,
            predicted_compute_ms: 0.0,
            explanation: vec![],
            error: None,
        }
    }

    fn stage(n: u8, a: u32, b: u32) -> PlacedStage {
        PlacedStage { node: NodeId([n; 32]), layers: LayerRange::new(a, b), memory_bytes: 1, gpus: Vec::new() }
    }

    #[test]
    fn a_placement_is_valid_only_when_it_covers_the_model_in_order_once_per_node() {
        let mut p = two_stages();
        assert!(p.is_valid(30));
        assert!(!p.is_valid(31));
        p.stages[1] = stage(1, 10, 30);
        assert!(!p.is_valid(30), "one node twice");
        p.stages[1] = stage(2, 11, 30);
        assert!(!p.is_valid(30), "a gap");
        p.stages.clear();
        assert!(!p.is_valid(30));
        // Written before `error` existed: still read.
        let back: ModelPlacement = serde_json::from_value(serde_json::json!({
            "model": "x", "generation": 2, "context": 8, "sessions": 1, "chunk": 8,
            "stages": [], "predicted_tok_s": 0.0, "explanation": []
        }))
        .unwrap();
        assert_eq!(back.error, None);
    }

    #[test]
    fn gpu_shares_must_fit_their_stage_and_the_head_goes_only_with_the_tails_last_layers() {
        let share = |layers, head| GpuShare { device: "CUDA0".into(), layers, head, memory_bytes: 1 };
        let mut p = two_stages();
        p.stages[0].gpus = vec![share(4, false), GpuShare { device: "CUDA1".into(), ..share(6, false) }];
        assert!(p.is_valid(30));
        assert_eq!(p.stages[0].gpu_layers(), 10);
        p.stages[0].gpus[1].layers = 7;
        assert!(!p.is_valid(30), "11 layers offloaded of 10");
        p.stages[0].gpus = vec![share(10, true)];
        assert!(!p.is_valid(30), "the head is on the tail");
        p.stages[0].gpus.clear();
        p.stages[1].gpus = vec![share(19, true)];
        assert!(p.is_valid(30), "the tail's last layers and the head on the GPU");
        p.stages[1].gpus = vec![share(10, true), GpuShare { device: "CUDA1".into(), ..share(9, false) }];
        assert!(!p.is_valid(30), "the head goes with the last layers, on the last GPU");
        p.stages[1].gpus = vec![share(4, false), share(5, false)];
        assert!(!p.is_valid(30), "one GPU named twice");
        // An offer and a stage written before GPUs existed are still read.
        let offer: Offer = serde_json::from_value(serde_json::json!({ "memory_bytes": 5 })).unwrap();
        assert!(offer.gpus.is_empty());
        let s: PlacedStage = serde_json::from_value(serde_json::json!({
            "node": NodeId([1; 32]), "layers": LayerRange::new(0, 3), "memory_bytes": 9
        }))
        .unwrap();
        assert_eq!((s.gpu_layers(), s.ram_bytes()), (0, 9));
    }
}
