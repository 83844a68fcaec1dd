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
    /// The memory the planner predicts it takes, bytes.
    pub memory_bytes: u64,
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

    /// Whether the stages cover `n_layer` blocks in order, one stage per node.
    pub fn is_valid(&self, n_layer: u32) -> bool {
        let mut next = 0;
        for (i, s) in self.stages.iter().enumerate() {
            if s.layers.start != next || s.layers.is_empty() || self.stages[..i].iter().any(|o| o.node == s.node) {
                return false;
            }
            next = s.layers.end;
        }
        !self.stages.is_empty() && next == n_layer && self.chunk > 0 && self.context >= self.chunk && self.sessions > 0
    }
}

/// The memory a node offers to models (`shoal serve --max-memory`, else what it has
/// free when it starts), so the leader plans within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Bytes.
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

    fn stage(n: u8, a: u32, b: u32) -> PlacedStage {
        PlacedStage { node: NodeId([n; 32]), layers: LayerRange::new(a, b), memory_bytes: 1 }
    }

    #[test]
    fn a_placement_is_valid_only_when_it_covers_the_model_in_order_once_per_node() {
        let mut p = ModelPlacement {
            model: "ab".repeat(32),
            generation: 1,
            context: 256,
            sessions: 1,
            chunk: 64,
            stages: vec![stage(1, 0, 10), stage(2, 10, 30)],
            predicted_tok_s: 1.0,
            explanation: vec![],
            error: None,
        };
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
}
