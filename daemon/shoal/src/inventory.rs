//! `shoal inventory`: what this node offers (host, OS, CPU, RAM, GPUs), collected
//! with sysinfo and llama.cpp's device list, and refreshed cheaply for the daemon.

use clap::Args;
use shoal_types::{DeviceInventory, NodeInventory};
use sysinfo::{CpuRefreshKind, System};

/// Arguments of `shoal inventory`.
#[derive(Args)]
pub struct InventoryArgs {
    /// Print the inventory as JSON (shoal_types::NodeInventory).
    #[arg(long)]
    pub json: bool,
}

/// This node's inventory, read once.
pub fn collect() -> NodeInventory {
    Refresher::new().refresh()
}

/// Keeps a node's inventory current at a small cost per refresh.
///
/// The full collection (host name, OS, CPU list and brand, core count) is done once,
/// in [`Refresher::new`]: those facts do not change while the process runs, and
/// reading them is the expensive part (sysinfo parses /proc/cpuinfo and the OS
/// release files, and enumerates every CPU). A refresh reads only what moves: RAM
/// (one read of /proc/meminfo) and the devices' free memory from llama.cpp.
pub struct Refresher {
    sys: System,
    fixed: NodeInventory,
    /// Whether CPU times were read once: usage is the busy share between two reads.
    cpu_primed: bool,
}

impl Refresher {
    /// Collect the facts that do not change (everything but memory and GPUs).
    pub fn new() -> Self {
        let mut sys = System::new();
        // The CPU list with each CPU's brand; usage figures are not needed.
        sys.refresh_cpu_list(CpuRefreshKind::nothing());
        let cpus = sys.cpus();
        let cores = match cpus.len() {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let fixed = NodeInventory {
            hostname: System::host_name().unwrap_or_default(),
            os: System::long_os_version().or_else(System::name).unwrap_or_else(|| std::env::consts::OS.into()),
            shoal_version: env!("CARGO_PKG_VERSION").into(),
            cpu_model: cpus.first().map(|c| c.brand().trim().to_owned()).unwrap_or_default(),
            cpu_cores: u32::try_from(cores).unwrap_or(u32::MAX),
            ..Default::default()
        };
        Refresher { sys, fixed, cpu_primed: false }
    }

    /// The inventory now: the fixed facts, with RAM, CPU use (since the last refresh)
    /// and GPU memory read afresh.
    pub fn refresh(&mut self) -> NodeInventory {
        self.sys.refresh_memory();
        // One read of /proc/stat; the first gives no share yet.
        self.sys.refresh_cpu_usage();
        let cpu = self.cpu_primed.then(|| (self.sys.global_cpu_usage().clamp(0.0, 100.0) * 10.0).round() as u32);
        self.cpu_primed = true;
        NodeInventory {
            ram_total_bytes: self.sys.total_memory(),
            ram_available_bytes: self.sys.available_memory(),
            cpu_used_permille: cpu,
            gpus: gpus(shoal_engine::devices()),
            ..self.fixed.clone()
        }
    }
}

impl Default for Refresher {
    fn default() -> Self {
        Self::new()
    }
}

/// The devices that are not the CPU (the CPU device's memory is the host's RAM,
/// already counted).
fn gpus(devices: Vec<DeviceInventory>) -> Vec<DeviceInventory> {
    devices.into_iter().filter(|d| d.kind != "cpu").collect()
}

/// `shoal inventory`: print this node's inventory, one fact per line or as JSON.
pub fn inventory(a: InventoryArgs) -> anyhow::Result<()> {
    let inv = collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&inv)?);
    } else {
        print!("{}", human(&inv));
    }
    Ok(())
}

/// One line per fact, then one line per GPU.
fn human(inv: &NodeInventory) -> String {
    use shoal_types::fmt_size;
    let mut s = format!(
        "hostname:      {}\nos:            {}\nshoal:         {}\ncpu:           {}\ncores:         {}\n\
         ram total:     {}\nram available: {}\n",
        inv.hostname,
        inv.os,
        inv.shoal_version,
        inv.cpu_model,
        inv.cpu_cores,
        fmt_size(inv.ram_total_bytes),
        fmt_size(inv.ram_available_bytes),
    );
    if inv.gpus.is_empty() {
        s.push_str("gpus:          none\n");
    }
    for g in &inv.gpus {
        s.push_str(&format!(
            "gpu:           {} ({}, {}): {} free of {}\n",
            g.name,
            g.description,
            g.kind,
            fmt_size(g.free_bytes),
            fmt_size(g.total_bytes)
        ));
    }
    s
}

/// CPU threads a stage uses unless told otherwise: this machine's physical cores (as
/// llama.cpp's own default; hyper-threads add little to its matrix work), since a node
/// runs at most one stage. Results do not depend on it because flash attention is off
/// (`shoal-engine`'s stage: its CPU kernel made logits depend on the thread count);
/// the test models give the same tokens and logits with 1 and 2 threads.
pub fn default_threads() -> u32 {
    sysinfo::System::physical_core_count()
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .map_or(1, |n| u32::try_from(n.max(1)).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, kind: &str) -> DeviceInventory {
        DeviceInventory {
            name: name.into(),
            description: format!("{name} device"),
            kind: kind.into(),
            free_bytes: 1 << 30,
            total_bytes: 2 << 30,
        }
    }

    #[test]
    fn the_cpu_device_is_not_a_gpu() {
        let got = gpus(vec![device("CPU", "cpu"), device("Vulkan0", "gpu"), device("Vulkan1", "igpu")]);
        assert_eq!(got.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["Vulkan0", "Vulkan1"]);
    }

    #[test]
    fn human_output_has_a_line_per_fact_and_per_gpu() {
        let inv = NodeInventory {
            hostname: "box".into(),
            cpu_cores: 8,
            gpus: vec![device("CUDA0", "gpu")],
            ..Default::default()
        };
        let text = human(&inv);
        assert_eq!(text.lines().count(), 8, "{text}");
        assert!(text.contains("gpu:           CUDA0 (CUDA0 device, gpu): 1.0 GiB free of 2.0 GiB"), "{text}");
        assert!(human(&NodeInventory::default()).contains("gpus:          none"));
    }

    #[test]
    fn a_refresh_keeps_the_fixed_facts_and_reads_memory() {
        let mut r = Refresher::new();
        let first = r.refresh();
        let second = r.refresh();
        assert!(first.ram_total_bytes >= first.ram_available_bytes && first.ram_available_bytes > 0);
        assert_eq!(first.ram_total_bytes, second.ram_total_bytes);
        assert_eq!(
            (&first.hostname, &first.cpu_model, first.cpu_cores),
            (&second.hostname, &second.cpu_model, second.cpu_cores)
        );
        assert_eq!(first.gpus.len(), second.gpus.len());
        // CPU use is a share between two reads: none at the first, a permille after.
        assert_eq!(first.cpu_used_permille, None);
        assert!(second.cpu_used_permille.is_some_and(|p| p <= 1000), "{:?}", second.cpu_used_permille);
    }
}
