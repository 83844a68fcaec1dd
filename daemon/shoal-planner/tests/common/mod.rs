//! Shared by the planner's tests: a seeded generator and random problems.
#![allow(dead_code)]

use shoal_planner::{Cluster, Device, Link, ModelProfile, Options, Plan};
use shoal_types::LayerRange;

/// The suite's seeded generator (the planner's tests seed it with raw states).
pub use shoal_testnet::Rng;

pub const MB: u64 = 1 << 20;

/// A random model of up to `max_units` units on 1–4 devices of 1–3 hosts.
pub fn random_problem(r: &mut Rng, max_units: u64) -> (ModelProfile, Cluster) {
    random_problem_sized(r, max_units, 3, 1, 4, false)
}

/// A random model of up to `max_units` units on `min_devices..=max_devices` devices
/// of up to `max_hosts` hosts; `varied`: per-layer sizes vary too.
pub fn random_problem_sized(
    r: &mut Rng,
    max_units: u64,
    max_hosts: u64,
    min_devices: u64,
    max_devices: u64,
    varied: bool,
) -> (ModelProfile, Cluster) {
    let period = [1, 1, 2, 6][r.below(4) as usize];
    let layers = (1 + r.below(max_units)) as u32 * period - if period > 1 && r.below(3) == 0 { 1 } else { 0 };
    let layer_mb = 20 + r.below(200);
    let layer_bytes =
        (0..layers).map(|_| if varied { (layer_mb / 2 + r.below(layer_mb)) * MB } else { layer_mb * MB }).collect();
    let model = ModelProfile {
        layers,
        layer_bytes,
        embed_bytes: r.below(300) * MB,
        head_bytes: r.below(300) * MB,
        tied_embeddings: false,
        other_bytes: r.below(10) * MB,
        n_embd: 512 << r.below(4),
        n_vocab: 32000,
        n_ff: 2048,
        period,
        sliding_window: r.below(2) == 1,
        refused_stage_layers: Vec::new(),
        kv_bytes_per_token_per_layer: 1024 * (1 + r.below(8)),
    };
    let hosts = 1 + r.below(max_hosts);
    let n_dev = min_devices + r.below(max_devices - min_devices + 1);
    let devices: Vec<Device> = (0..n_dev)
        .map(|i| {
            let host = format!("h{}", r.below(hosts));
            Device {
                id: format!("{host}/d{i}"),
                host,
                memory_bytes: (700 + r.below(u64::from(layers) * layer_mb * 3 / 2)) * MB,
                ms_per_layer: r.float(0.05, 3.0),
                prefill_ms_per_layer_token: None,
                head_ms: r.float(0.0, 5.0),
                wake_ms: r.float(0.0, 1.0),
                keepalive: r.below(2) == 0,
                estimated: false,
                offload: false,
            }
        })
        .collect();
    let mut links = Vec::new();
    for a in 0..hosts {
        for b in a..hosts {
            if r.below(2) == 0 {
                let ms_per_frame = r.float(0.01, 10.0);
                links.push(Link { hosts: [format!("h{a}"), format!("h{b}")], ms_per_frame, mbit_per_s: None });
            }
        }
    }
    (model, Cluster { devices, links })
}

/// A plan fits every device, covers every layer once in order on period boundaries,
/// and keeps each host's devices adjacent.
pub fn check_plan_is_valid(model: &ModelProfile, cluster: &Cluster, opts: &Options, p: &Plan) {
    let mut at = 0;
    let mut hosts_seen: Vec<&str> = Vec::new();
    for s in &p.stages {
        assert_eq!(s.first, at, "stages must be contiguous: {p:#?}");
        assert!(s.last > s.first);
        assert!(s.last % model.period == 0 || s.last == model.layers, "boundary off the period: {p:#?}");
        at = s.last;
        let d = cluster.devices.iter().find(|d| d.id == s.device).unwrap();
        let need = model.stage_memory(LayerRange { start: s.first, end: s.last }, &opts.sizing).total();
        assert_eq!(need, s.memory_bytes);
        assert!(need <= d.memory_bytes - opts.reserve_bytes.min(d.memory_bytes), "over memory on {}: {p:#?}", s.device);
        if hosts_seen.last() != Some(&s.host.as_str()) {
            assert!(!hosts_seen.contains(&s.host.as_str()), "host {} split apart: {p:#?}", s.host);
            hosts_seen.push(&s.host);
        }
    }
    assert_eq!(at, model.layers);
    assert!(p.fits);
}
