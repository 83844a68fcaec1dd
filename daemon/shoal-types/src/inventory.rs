//! What a node has to offer (memory, CPU, GPUs) and which cluster it belongs to:
//! plain data, filled by the daemon (sysinfo + llama.cpp's device list), advertised
//! over mDNS in summary and kept in the cluster state in full.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A node's id: its Ed25519 public key (the key its TLS certificate carries). Shown
/// as 64 hex digits; serialized as that string.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub [u8; 32]);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first 8 hex digits are enough to tell nodes apart in logs.
        write!(f, "NodeId({})", &self.to_string()[..8])
    }
}

/// A string that is not 64 hex digits.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a node id (64 hex digits)")]
pub struct BadNodeId(pub String);

impl FromStr for NodeId {
    type Err = BadNodeId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let bad = || BadNodeId(s.chars().take(80).collect());
        Ok(NodeId(hex_bytes(s).ok_or_else(bad)?))
    }
}

impl Serialize for NodeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NodeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `N` bytes from exactly `2N` hex digits.
fn hex_bytes<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A cluster's id: 16 random bytes made when the first node creates the cluster,
/// shown as 32 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterId(pub [u8; 16]);

impl Serialize for ClusterId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ClusterId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterId({})", &self.to_string()[..8])
    }
}

/// A string that is not 32 hex digits.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a cluster id (32 hex digits)")]
pub struct BadClusterId(pub String);

impl FromStr for ClusterId {
    type Err = BadClusterId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        hex_bytes(s).map(ClusterId).ok_or_else(|| BadClusterId(s.chars().take(80).collect()))
    }
}

/// What a node is for: a PC someone uses, or a headless hub box (preferred as leader).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A desktop or laptop that people also use.
    #[default]
    Pc,
    /// A dedicated always-on box.
    Hub,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Pc => "pc",
            Role::Hub => "hub",
        })
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pc" => Ok(Role::Pc),
            "hub" => Ok(Role::Hub),
            other => Err(format!("{other:?} is not a role (pc or hub)")),
        }
    }
}

/// One accelerator (or the CPU) as llama.cpp's backend registry lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInventory {
    /// Backend device name, e.g. "CPU", "Vulkan0", "CUDA0".
    pub name: String,
    /// Human description, e.g. "NVIDIA GeForce RTX 4070".
    pub description: String,
    /// "cpu", "gpu" or "igpu" (llama.cpp's device type).
    pub kind: String,
    /// Memory free on the device now, bytes.
    pub free_bytes: u64,
    /// Memory the device has, bytes.
    pub total_bytes: u64,
}

/// What a node has, refreshed periodically.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// The machine's host name (for people; ids are keys).
    pub hostname: String,
    /// Operating system and version, e.g. "Debian GNU/Linux 12".
    pub os: String,
    /// Shoal's version.
    pub shoal_version: String,
    /// CPU model name.
    pub cpu_model: String,
    /// Logical CPU cores.
    pub cpu_cores: u32,
    /// RAM installed, bytes.
    pub ram_total_bytes: u64,
    /// RAM available to new allocations now, bytes.
    pub ram_available_bytes: u64,
    /// CPU busy over every core since the previous refresh, in thousandths (absent:
    /// not measured yet, or an older node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_used_permille: Option<u32>,
    /// GPUs and iGPUs (not the CPU device) from llama.cpp's backend registry.
    pub gpus: Vec<DeviceInventory>,
}

impl NodeInventory {
    /// Free memory over every GPU, bytes.
    pub fn vram_free_bytes(&self) -> u64 {
        self.gpus.iter().map(|g| g.free_bytes).sum()
    }

    /// A short summary of the devices for mDNS and logs, e.g. "8c/31G+RTX 4070 12G",
    /// at most `max` bytes (cut on a character boundary).
    pub fn summary(&self, max: usize) -> String {
        let gib = |b: u64| (b + (1 << 29)) >> 30;
        let mut s = format!("{}c/{}G", self.cpu_cores, gib(self.ram_total_bytes));
        for g in &self.gpus {
            s.push_str(&format!("+{} {}G", g.description, gib(g.total_bytes)));
        }
        if s.len() > max {
            let mut cut = max;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_round_trip_and_bad_ones_are_refused() {
        let id = ClusterId([0xab; 16]);
        assert_eq!(id.to_string().parse::<ClusterId>().unwrap(), id);
        assert!("abc".parse::<ClusterId>().is_err());
        assert!("zz".repeat(16).parse::<ClusterId>().is_err());
    }

    #[test]
    fn ids_serialize_as_hex_strings() {
        let id = NodeId([7; 32]);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<NodeId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<NodeId>("\"07\"").is_err());
        let c = ClusterId([9; 16]);
        assert_eq!(serde_json::from_str::<ClusterId>(&serde_json::to_string(&c).unwrap()).unwrap(), c);
    }

    #[test]
    fn summary_is_cut_on_a_char_boundary() {
        let inv = NodeInventory {
            cpu_cores: 8,
            ram_total_bytes: 32 << 30,
            gpus: vec![DeviceInventory {
                name: "Vulkan0".into(),
                description: "Ünïcödé GPU".into(),
                kind: "gpu".into(),
                free_bytes: 1 << 30,
                total_bytes: 12 << 30,
            }],
            ..Default::default()
        };
        assert_eq!(inv.summary(100), "8c/32G+Ünïcödé GPU 12G");
        for max in 0..30 {
            assert!(inv.summary(max).len() <= max);
        }
    }
}
