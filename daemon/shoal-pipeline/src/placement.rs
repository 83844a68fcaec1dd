//! The placement file: which node runs which layers of which model. Until the leader
//! (cluster issue) hands placements out, an owner writes it by hand (or `shoal plan`
//! will); every node of the pipeline reads the same file.
//!
//! ```toml
//! model = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"   # a local copy on every node
//! context = 2048          # positions per session
//! chunk = 128             # prefill chunk size C (every stage's micro-batch)
//! sessions = 4            # sessions held at once
//! clients = ["<node id>"] # extra keys allowed to ask for generations (optional)
//!
//! [[stage]]
//! node = "<node id: 64 hex digits, from `shoal key`>"
//! addr = "127.0.0.1:7101"
//! layers = [0, 15]
//! ```

use serde::{Deserialize, Serialize};
use shoal_net::NodeId;
use shoal_types::LayerRange;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// A parsed, validated placement.
#[derive(Clone, Debug)]
pub struct Placement {
    /// Path of the model on each node.
    pub model: PathBuf,
    /// Positions per session.
    pub context: u32,
    /// Prefill chunk size C.
    pub chunk: u32,
    /// Sessions held at once.
    pub sessions: u32,
    /// Stages in chain order; stage 0's node is the coordinator.
    pub stages: Vec<StagePlace>,
    /// Keys, besides the stage nodes', that may ask for generations.
    pub clients: Vec<NodeId>,
}

/// Where one stage runs.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePlace {
    /// The node's key.
    pub node: NodeId,
    /// Its QUIC address.
    pub addr: SocketAddr,
    /// The layers it runs.
    pub layers: LayerRange,
}

/// Why a placement file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: InvalidPlacement,
    },
}

/// What is wrong with a placement's content.
#[derive(Debug, thiserror::Error)]
pub enum InvalidPlacement {
    #[error("no [[stage]] entries")]
    NoStages,
    #[error("stage {index}: {why}")]
    Stage { index: usize, why: String },
    #[error("context ({context}) must be at least the chunk size ({chunk}), and both positive; sessions ≥ 1")]
    Sizes { context: u32, chunk: u32 },
    #[error("node {0} holds two stages; one stage per node is supported so far")]
    TwoStagesOneNode(String),
}

/// The file's schema, both ways: parsed into a [`Placement`] by [`Placement::parse`],
/// written from one by [`Placement::to_toml`].
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawPlacement {
    model: PathBuf,
    #[serde(default = "default_context")]
    context: u32,
    #[serde(default = "default_chunk")]
    chunk: u32,
    #[serde(default = "default_sessions")]
    sessions: u32,
    #[serde(default)]
    clients: Vec<String>,
    stage: Vec<RawStage>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    node: String,
    addr: String,
    layers: [u32; 2],
}

fn default_context() -> u32 {
    2048
}
fn default_chunk() -> u32 {
    128
}
fn default_sessions() -> u32 {
    4
}

impl Placement {
    /// Read and validate the placement file at `path`.
    pub fn load(path: &Path) -> Result<Placement, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_owned(), source })?;
        Placement::parse(&text, path)
    }

    /// Parse placement text; `path` names it in errors and anchors a relative model path.
    pub fn parse(text: &str, path: &Path) -> Result<Placement, PlacementError> {
        let raw: RawPlacement = toml::from_str(text)
            .map_err(|e| PlacementError::Parse { path: path.to_owned(), message: e.to_string() })?;
        let invalid = |source| PlacementError::Invalid { path: path.to_owned(), source };
        if raw.stage.is_empty() {
            return Err(invalid(InvalidPlacement::NoStages));
        }
        if raw.chunk == 0 || raw.context < raw.chunk || raw.sessions == 0 {
            return Err(invalid(InvalidPlacement::Sizes { context: raw.context, chunk: raw.chunk }));
        }
        let mut stages: Vec<StagePlace> = Vec::new();
        for (index, s) in raw.stage.iter().enumerate() {
            let bad = |why: String| invalid(InvalidPlacement::Stage { index, why });
            let node: NodeId = s.node.parse().map_err(|e: shoal_types::BadNodeId| bad(e.to_string()))?;
            let addr: SocketAddr = s.addr.parse().map_err(|_| bad(format!("address {:?} is not IP:port", s.addr)))?;
            let layers = LayerRange::new(s.layers[0], s.layers[1]);
            let expect = stages.last().map_or(0, |p| p.layers.end);
            if layers.start != expect || layers.is_empty() {
                return Err(bad(format!("layers {layers} must start at {expect} and be non-empty")));
            }
            if stages.iter().any(|p| p.node == node) {
                return Err(invalid(InvalidPlacement::TwoStagesOneNode(s.node.clone())));
            }
            stages.push(StagePlace { node, addr, layers });
        }
        let clients = raw
            .clients
            .iter()
            .map(|c| c.parse())
            .collect::<Result<Vec<NodeId>, _>>()
            .map_err(|e| invalid(InvalidPlacement::Stage { index: 0, why: format!("clients: {e}") }))?;
        let model =
            if raw.model.is_relative() { path.parent().unwrap_or(Path::new(".")).join(&raw.model) } else { raw.model };
        Ok(Placement { model, context: raw.context, chunk: raw.chunk, sessions: raw.sessions, stages, clients })
    }

    /// The placement as file text, which [`Placement::parse`] reads back to an equal
    /// placement (the model path as given: absolute, or relative to the file).
    pub fn to_toml(&self) -> String {
        let raw = RawPlacement {
            model: self.model.clone(),
            context: self.context,
            chunk: self.chunk,
            sessions: self.sessions,
            clients: self.clients.iter().map(|c| c.to_string()).collect(),
            stage: self
                .stages
                .iter()
                .map(|s| RawStage {
                    node: s.node.to_string(),
                    addr: s.addr.to_string(),
                    layers: [s.layers.start, s.layers.end],
                })
                .collect(),
        };
        // Invariant: plain strings and integers, and the stage table after the scalars,
        // which is all TOML needs to serialise a struct.
        toml::to_string(&raw).expect("a placement serialises as TOML")
    }

    /// Every key the pipeline's nodes accept: the stage nodes and the clients.
    pub fn trusted(&self) -> Vec<NodeId> {
        self.stages.iter().map(|s| s.node).chain(self.clients.iter().copied()).collect()
    }

    /// The index of `node`'s stage.
    pub fn stage_of(&self, node: NodeId) -> Option<usize> {
        self.stages.iter().position(|s| s.node == node)
    }

    /// Layers in the whole model, as the placement covers them.
    pub fn n_layer(&self) -> u32 {
        self.stages.last().map_or(0, |s| s.layers.end)
    }

    /// The stage after `index`; after the tail comes the coordinator (stage 0), which
    /// receives the sampled tokens.
    pub fn next(&self, index: usize) -> &StagePlace {
        &self.stages[(index + 1) % self.stages.len()]
    }

    /// The stage before `index` in the same ring (the tail, before the coordinator):
    /// the only node whose pipeline frames `index` accepts.
    pub fn prev(&self, index: usize) -> &StagePlace {
        &self.stages[(index + self.stages.len() - 1) % self.stages.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: char) -> String {
        c.to_string().repeat(64)
    }

    fn text(stages: &str) -> String {
        format!("model = \"m.gguf\"\nchunk = 32\n{stages}")
    }

    #[test]
    fn parses_and_validates() {
        let t = text(&format!(
            "[[stage]]\nnode = \"{}\"\naddr = \"127.0.0.1:1\"\nlayers = [0, 10]\n[[stage]]\nnode = \"{}\"\naddr = \"127.0.0.1:2\"\nlayers = [10, 30]\n",
            key('a'),
            key('b')
        ));
        let p = Placement::parse(&t, Path::new("/etc/shoal/p.toml")).unwrap();
        assert_eq!(p.model, Path::new("/etc/shoal/m.gguf"));
        assert_eq!((p.chunk, p.context, p.n_layer()), (32, 2048, 30));
        assert_eq!(p.next(1).layers.start, 0);
        assert_eq!(p.stage_of(key('b').parse().unwrap()), Some(1));
    }

    #[test]
    fn a_placement_writes_itself_and_reads_back_equal() {
        let node = |c: char| key(c).parse::<NodeId>().unwrap();
        let p = Placement {
            model: PathBuf::from("/models/m \"odd\" name.gguf"),
            context: 4096,
            chunk: 64,
            sessions: 2,
            stages: vec![
                StagePlace { node: node('a'), addr: "127.0.0.1:7101".parse().unwrap(), layers: LayerRange::new(0, 12) },
                StagePlace { node: node('b'), addr: "[::1]:7102".parse().unwrap(), layers: LayerRange::new(12, 30) },
            ],
            clients: vec![node('c')],
        };
        let back = Placement::parse(&p.to_toml(), Path::new("/elsewhere/p.toml")).unwrap();
        assert_eq!(back.model, p.model);
        assert_eq!((back.context, back.chunk, back.sessions), (4096, 64, 2));
        assert_eq!(back.stages, p.stages);
        assert_eq!(back.clients, p.clients);
    }

    #[test]
    fn refuses_bad_placements() {
        let st = |node: String, addr: &str, a: u32, b: u32| {
            format!("[[stage]]\nnode = \"{node}\"\naddr = \"{addr}\"\nlayers = [{a}, {b}]\n")
        };
        let cases = [
            (text(""), "missing field"),
            (text(&(st(key('a'), "127.0.0.1:1", 0, 10) + &st(key('b'), "127.0.0.1:2", 12, 30))), "must start at 10"),
            (text(&st(key('a'), "localhost", 0, 10)), "not IP:port"),
            (text(&st("xyz".into(), "127.0.0.1:1", 0, 10)), "not a node id"),
            (text(&(st(key('a'), "127.0.0.1:1", 0, 10) + &st(key('a'), "127.0.0.1:2", 10, 20))), "two stages"),
            (text(&st(key('a'), "127.0.0.1:1", 0, 10)) + "bogus = 1\n", "unknown field"),
            ("model = \"m\"\nchunk = 0\n".to_string() + &st(key('a'), "127.0.0.1:1", 0, 10), "chunk size"),
        ];
        for (t, want) in cases {
            let e = Placement::parse(&t, Path::new("p.toml")).expect_err(want).to_string();
            assert!(e.contains(want) && e.starts_with("p.toml"), "{e:?} should say {want:?}");
        }
    }
}
