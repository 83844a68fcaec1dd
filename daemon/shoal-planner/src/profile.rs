//! Cluster profiles: the devices (memory, measured speed), the links between hosts,
//! and the TOML format `shoal plan --profile` reads (documented in docs/planning.md).
//! Parsing is from a string; reading files is the caller's business.

use crate::model::ModelProfile;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Time of a decode frame between two devices of one host when no `[[link]]` says.
pub const SAME_HOST_MS: f64 = 0.05;
/// Time of a decode frame between hosts when nothing was measured (a wired LAN).
pub const ASSUMED_LINK_MS: f64 = 1.0;
/// Link bandwidth when none is given, for prefill frames.
pub const ASSUMED_MBIT_PER_S: f64 = 1000.0;

/// One compute device: a GPU, an iGPU, or a host's CPU and RAM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// "host/device", e.g. "desktop/gpu0".
    pub id: String,
    /// The machine it is in; devices of one host sit next to each other in a chain.
    pub host: String,
    /// Memory Shoal may use on it (before the planner's reserve).
    pub memory_bytes: u64,
    /// Decode time of one layer for one token, ms.
    pub ms_per_layer: f64,
    /// Prefill time of one layer per prompt token, ms [default: half of `ms_per_layer`].
    #[serde(default)]
    pub prefill_ms_per_layer_token: Option<f64>,
    /// Time of the output norm + LM head + sampling for one token, ms.
    #[serde(default)]
    pub head_ms: f64,
    /// Extra latency when work arrives at the device after it idled (waking a sleeping
    /// GPU or thread), ms.
    #[serde(default)]
    pub wake_ms: f64,
    /// The stage keeps the device awake while a session is active: no wake penalty.
    #[serde(default)]
    pub keepalive: bool,
    /// The speeds are estimates (from memory bandwidth), not measurements.
    #[serde(default)]
    pub estimated: bool,
    /// A GPU that runs a node's layers beside its CPU in one llama.cpp context, which
    /// offloads a stage's *last* layers and keeps the input embedding in RAM: in its
    /// host's run it comes after the host's other devices, never first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload: bool,
}

/// Memory bandwidth assumed for a CPU whose speed was not measured (DDR4 dual channel).
pub const ASSUMED_GB_PER_S: f64 = 20.0;
/// Memory bandwidth assumed for a GPU whose speed was not measured: a mid-range card
/// (an RTX 3060 has 360 GB/s, an RX 7600 288, an Arc A750 512), so a GPU is planned as
/// about 15× a CPU, which is what token generation on one measures.
pub const ASSUMED_GPU_GB_PER_S: f64 = 300.0;

impl Device {
    /// A machine's CPU with `memory` bytes for `model`, its speed estimated from
    /// [`ASSUMED_GB_PER_S`] (each token reads every weight once): the planner's device
    /// for a member that has not measured itself.
    pub fn estimated_cpu(host: String, memory: u64, model: &ModelProfile) -> Device {
        let total = model.layer_bytes.iter().fold(0u64, |a, &b| a.saturating_add(b));
        let avg_layer = total as f64 / f64::from(model.layers.max(1));
        Device {
            id: format!("{host}/cpu"),
            host,
            memory_bytes: memory,
            ms_per_layer: avg_layer / (ASSUMED_GB_PER_S * 1e9) * 1000.0,
            prefill_ms_per_layer_token: None,
            head_ms: model.head_bytes as f64 / (ASSUMED_GB_PER_S * 1e9) * 1000.0,
            wake_ms: 0.0,
            keepalive: false,
            estimated: true,
            offload: false,
        }
    }

    /// A machine's GPU (backend device `name`, e.g. "CUDA0") with `memory` bytes for
    /// `model`, its speed estimated from [`ASSUMED_GPU_GB_PER_S`].
    pub fn estimated_gpu(host: String, name: &str, memory: u64, model: &ModelProfile) -> Device {
        let cpu = Device::estimated_cpu(host, memory, model);
        let scale = ASSUMED_GB_PER_S / ASSUMED_GPU_GB_PER_S;
        Device {
            id: format!("{}/{name}", cpu.host),
            ms_per_layer: cpu.ms_per_layer * scale,
            head_ms: cpu.head_ms * scale,
            offload: true,
            ..cpu
        }
    }

    /// Prefill time of one layer per token, ms.
    pub fn prefill_ms(&self) -> f64 {
        self.prefill_ms_per_layer_token.unwrap_or(self.ms_per_layer / 2.0)
    }

    /// Wake-up cost paid by a frame arriving here, ms.
    pub fn wake(&self) -> f64 {
        if self.keepalive {
            0.0
        } else {
            self.wake_ms
        }
    }
}

/// A measured link between two hosts (or a host with itself).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// The two hosts (order does not matter; the same host twice for devices of one host).
    pub hosts: [String; 2],
    /// One-way time of a decode frame, ms (wire, stack and queues).
    pub ms_per_frame: f64,
    /// Bandwidth, for prefill frames [default: 1000].
    #[serde(default)]
    pub mbit_per_s: Option<f64>,
}

/// The devices and links the planner chooses from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Every device that could hold a stage.
    pub devices: Vec<Device>,
    /// Measured links; unlisted pairs get a default.
    pub links: Vec<Link>,
}

/// One-way cost of a frame between two hosts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// A decode frame, ms.
    pub ms_per_frame: f64,
    /// Bandwidth for bigger frames.
    pub mbit_per_s: f64,
    /// Nothing was measured: a default.
    pub assumed: bool,
}

impl Cluster {
    /// The cost of sending from host `a` to host `b`.
    pub fn link(&self, a: &str, b: &str) -> LinkCost {
        let found =
            self.links.iter().find(|l| (l.hosts[0] == a && l.hosts[1] == b) || (l.hosts[0] == b && l.hosts[1] == a));
        match found {
            Some(l) => LinkCost {
                ms_per_frame: l.ms_per_frame,
                mbit_per_s: l.mbit_per_s.unwrap_or(ASSUMED_MBIT_PER_S),
                assumed: false,
            },
            None if a == b => {
                LinkCost { ms_per_frame: SAME_HOST_MS, mbit_per_s: ASSUMED_MBIT_PER_S * 10.0, assumed: false }
            }
            None => LinkCost { ms_per_frame: ASSUMED_LINK_MS, mbit_per_s: ASSUMED_MBIT_PER_S, assumed: true },
        }
    }

    /// Check ids, hosts and numbers.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |m: String| Err(ProfileError::Invalid(m));
        for (i, d) in self.devices.iter().enumerate() {
            if d.id.is_empty() || d.host.is_empty() {
                return bad(format!("device {} has an empty id or host", i + 1));
            }
            if self.devices[..i].iter().any(|o| o.id == d.id) {
                return bad(format!("device {:?} is listed twice", d.id));
            }
            let times = [Some(d.ms_per_layer), d.prefill_ms_per_layer_token, Some(d.head_ms), Some(d.wake_ms)];
            if times.iter().flatten().any(|t| !t.is_finite() || *t < 0.0) {
                return bad(format!("device {:?}: times must be finite and not negative", d.id));
            }
        }
        for l in &self.links {
            for h in &l.hosts {
                if !self.devices.iter().any(|d| &d.host == h) {
                    return bad(format!("link {:?} names host {h:?}, which has no device", l.hosts));
                }
            }
            if !l.ms_per_frame.is_finite()
                || l.ms_per_frame < 0.0
                || l.mbit_per_s.is_some_and(|b| b.is_nan() || b <= 0.0)
            {
                return bad(format!("link {:?}: ms_per_frame must be ≥ 0 and mbit_per_s > 0", l.hosts));
            }
        }
        Ok(())
    }
}

/// Where the model's sizes come from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSpec {
    /// Read them from this GGUF (the caller does).
    Path(PathBuf),
    /// Given in the profile.
    Given(ModelProfile),
}

/// A parsed profile file.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The model.
    pub model: ModelSpec,
    /// Context length, when the profile sets one.
    pub context: Option<u32>,
    /// The devices and links.
    pub cluster: Cluster,
}

/// The most layers a `[model]` with sizes may have: the GGUF reader's limit too.
pub const MAX_LAYERS: u32 = 4096;

/// Why a profile was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Not valid TOML, or fields of the wrong type or unknown.
    #[error("profile: {0}")]
    Toml(String),
    /// Valid TOML with values that make no sense.
    #[error("profile: {0}")]
    Invalid(String),
}

/// The `[model]` table as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelToml {
    path: Option<PathBuf>,
    layers: Option<u32>,
    layer_bytes: Option<u64>,
    head_bytes: Option<u64>,
    embed_bytes: Option<u64>,
    n_embd: Option<u32>,
    #[serde(default = "one")]
    period: u32,
    kv_bytes_per_token_per_layer: Option<u64>,
    context: Option<u32>,
    #[serde(default)]
    n_vocab: u32,
    n_ff: Option<u32>,
    #[serde(default)]
    other_bytes: u64,
    #[serde(default)]
    tied_embeddings: bool,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileToml {
    model: ModelToml,
    #[serde(default)]
    device: Vec<Device>,
    #[serde(default)]
    link: Vec<Link>,
}

impl Profile {
    /// Parse and validate a profile.
    pub fn parse(text: &str) -> Result<Profile, ProfileError> {
        let t: ProfileToml = toml::from_str(text).map_err(|e| ProfileError::Toml(e.to_string()))?;
        let m = t.model;
        let model = match (&m.path, m.layers) {
            (Some(p), None) => ModelSpec::Path(p.clone()),
            (Some(_), Some(_)) => {
                return Err(ProfileError::Invalid("[model] has both `path` and sizes: give one or the other".into()))
            }
            (None, _) => {
                let need = |v: Option<u64>, name: &str| {
                    v.ok_or_else(|| ProfileError::Invalid(format!("[model] needs `{name}` (or `path` to a GGUF)")))
                };
                let layers = need(m.layers.map(u64::from), "layers")? as u32;
                let n_embd = need(m.n_embd.map(u64::from), "n_embd")? as u32;
                if layers == 0 || n_embd == 0 || m.period == 0 {
                    return Err(ProfileError::Invalid("[model] layers, n_embd and period must be positive".into()));
                }
                // Bounded before `layer_bytes` is allocated (one u64 per layer): a
                // four-digit text must not ask for 32 GiB.
                if layers > MAX_LAYERS {
                    return Err(ProfileError::Invalid(format!(
                        "[model] layers = {layers} is over the limit of {MAX_LAYERS}"
                    )));
                }
                // The default n_ff is 4·n_embd, which must fit its u32.
                let n_ff = match m.n_ff {
                    Some(n_ff) => n_ff,
                    None => n_embd.checked_mul(4).ok_or_else(|| {
                        ProfileError::Invalid(format!("[model] n_embd = {n_embd} is too large without `n_ff`"))
                    })?,
                };
                ModelSpec::Given(ModelProfile {
                    layers,
                    layer_bytes: vec![need(m.layer_bytes, "layer_bytes")?; layers as usize],
                    embed_bytes: need(m.embed_bytes, "embed_bytes")?,
                    head_bytes: need(m.head_bytes, "head_bytes")?,
                    tied_embeddings: m.tied_embeddings,
                    other_bytes: m.other_bytes,
                    n_embd,
                    n_vocab: m.n_vocab,
                    n_ff,
                    period: m.period,
                    sliding_window: false,
                    refused_stage_layers: Vec::new(),
                    kv_bytes_per_token_per_layer: need(m.kv_bytes_per_token_per_layer, "kv_bytes_per_token_per_layer")?,
                })
            }
        };
        if m.context == Some(0) {
            return Err(ProfileError::Invalid("[model] context must be positive".into()));
        }
        let cluster = Cluster { devices: t.device, links: t.link };
        cluster.validate()?;
        Ok(Profile { model, context: m.context, cluster })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[model]
layers = 4
layer_bytes = 100
head_bytes = 10
embed_bytes = 10
n_embd = 8
kv_bytes_per_token_per_layer = 2
context = 64

[[device]]
id = "a/cpu"
host = "a"
memory_bytes = 1_000_000
ms_per_layer = 1.0

[[link]]
hosts = ["a", "a"]
ms_per_frame = 0.2
"#;

    #[test]
    fn a_profile_parses_and_links_default() {
        let p = Profile::parse(GOOD).unwrap();
        assert_eq!(p.context, Some(64));
        let ModelSpec::Given(m) = &p.model else { panic!("sizes were given") };
        assert_eq!((m.layers, m.layer_bytes.len(), m.period, m.n_ff), (4, 4, 1, 32));
        assert_eq!(p.cluster.link("a", "a").ms_per_frame, 0.2);
        assert!(p.cluster.link("a", "b").assumed);
        assert_eq!(p.cluster.devices[0].prefill_ms(), 0.5);
    }

    #[test]
    fn huge_layer_count_is_refused_before_allocating() {
        // Parsing once allocated one u64 per layer: 4e9 layers asked for 32 GB.
        let text = GOOD.replace("layers = 4\n", "layers = 4000000000\n");
        let e = Profile::parse(&text).unwrap_err().to_string();
        assert!(e.contains("over the limit of 4096"), "{e}");
        let at_limit = GOOD.replace("layers = 4\n", &format!("layers = {MAX_LAYERS}\n"));
        assert!(Profile::parse(&at_limit).is_ok());
    }

    #[test]
    fn huge_n_embd_without_n_ff_is_refused() {
        // The default n_ff, 4·n_embd, overflowed its u32.
        let text = GOOD.replace("n_embd = 8\n", "n_embd = 1073741824\n");
        let e = Profile::parse(&text).unwrap_err().to_string();
        assert!(e.contains("n_embd = 1073741824 is too large"), "{e}");
        let given = GOOD.replace("n_embd = 8\n", "n_embd = 1073741824\nn_ff = 7\n");
        let ModelSpec::Given(m) = Profile::parse(&given).unwrap().model else { panic!("sizes were given") };
        assert_eq!(m.n_ff, 7);
    }

    #[test]
    fn bad_profiles_are_refused_with_a_reason() {
        let cases = [
            (GOOD.replace("layers = 4\n", ""), "layers"),
            (GOOD.replace("[model]\n", "[model]\npath = \"m.gguf\"\n"), "both"),
            (GOOD.replace("ms_per_layer = 1.0", "ms_per_layer = -1.0"), "negative"),
            (GOOD.replace("hosts = [\"a\", \"a\"]", "hosts = [\"a\", \"zz\"]"), "zz"),
            (GOOD.replace("memory_bytes", "memory"), "memory"),
            (
                GOOD.to_string() + "\n[[device]]\nid = \"a/cpu\"\nhost = \"a\"\nmemory_bytes = 1\nms_per_layer = 1.0\n",
                "twice",
            ),
            ("not toml [".to_string(), "profile"),
        ];
        for (text, want) in cases {
            let e = Profile::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        }
    }
}
