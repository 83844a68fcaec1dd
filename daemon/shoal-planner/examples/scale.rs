//! The planner at scale: planning time for 8 to 48 devices, and how the scalable
//! search's pick compares with the exhaustive oracle's where that is still feasible.
//!
//! `cargo run --release -p shoal-planner --example scale`
//!
//! Clusters are homes of PCs, each with a CPU (RAM) and 1–3 GPUs of mixed sizes and
//! speeds, some hosts on WiFi; the model is sized so that it needs a good part of
//! the cluster (a 405B-class model from 32 devices on). Everything is seeded: the
//! same figures every run, up to the clock.

use shoal_planner::plan::plan_exhaustive;
use shoal_planner::{plan, Cluster, Device, Link, ModelProfile, Options};
use shoal_testnet::Rng;
use std::time::Instant;

const GB: u64 = 1_000_000_000;

/// A Llama-like model of `layers` blocks of `layer_gb` GB.
fn model(layers: u32, layer_gb: f64, n_embd: u32) -> ModelProfile {
    ModelProfile {
        layers,
        layer_bytes: vec![(layer_gb * GB as f64) as u64; layers as usize],
        embed_bytes: u64::from(n_embd) * 128_256 * 9 / 16,
        head_bytes: u64::from(n_embd) * 128_256 * 9 / 16,
        tied_embeddings: false,
        other_bytes: 1 << 20,
        n_embd,
        n_vocab: 128_256,
        n_ff: n_embd * 13 / 4,
        period: 1,
        sliding_window: false,
        refused_stage_layers: Vec::new(),
        kv_bytes_per_token_per_layer: 4096,
    }
}

/// `devices` devices on hosts of one CPU and 1–3 GPUs.
fn cluster(devices: usize, seed: u64) -> Cluster {
    let mut r = Rng::from_state(seed);
    let mut out = Vec::new();
    let mut links = Vec::new();
    let mut h = 0;
    while out.len() < devices {
        let host = format!("pc{h}");
        out.push(Device {
            id: format!("{host}/cpu"),
            host: host.clone(),
            memory_bytes: [16, 32, 64][r.below(3) as usize] * GB,
            ms_per_layer: 6.0 + r.below(40) as f64 / 10.0,
            prefill_ms_per_layer_token: None,
            head_ms: 20.0,
            wake_ms: 0.2,
            keepalive: false,
            estimated: false,
            offload: false,
        });
        let gpus = 1 + r.below(3) as usize;
        for g in 0..gpus.min(devices - out.len()) {
            out.push(Device {
                id: format!("{host}/gpu{g}"),
                host: host.clone(),
                memory_bytes: [8, 12, 16, 24][r.below(4) as usize] * GB,
                ms_per_layer: 0.3 + r.below(50) as f64 / 100.0,
                prefill_ms_per_layer_token: None,
                head_ms: 1.5,
                wake_ms: 0.5,
                keepalive: true,
                estimated: false,
                offload: false,
            });
        }
        // One host in four is on WiFi.
        for other in 0..h {
            let wifi = h % 4 == 3 || other % 4 == 3;
            let ms_per_frame = if wifi { 4.0 + r.below(40) as f64 / 10.0 } else { 0.3 + r.below(5) as f64 / 10.0 };
            links.push(Link { hosts: [format!("pc{other}"), host.clone()], ms_per_frame, mbit_per_s: None });
        }
        h += 1;
    }
    Cluster { devices: out, links }
}

fn main() {
    let opts = Options::default();
    println!("devices hosts model          plan (ms)  exhaustive (ms)  decode ms new/oracle  stages  tok/s");
    for (devices, m, name) in [
        (8, model(80, 0.50, 8192), "70B-class"),
        (10, model(80, 0.50, 8192), "70B-class"),
        (16, model(96, 1.20, 12288), "180B-class"),
        (32, model(126, 1.93, 16384), "405B-class"),
        (48, model(126, 1.93, 16384), "405B-class"),
    ] {
        let c = cluster(devices, 0x5ca1e + devices as u64);
        let hosts = {
            let mut h: Vec<&str> = c.devices.iter().map(|d| d.host.as_str()).collect();
            h.dedup();
            h.len()
        };
        let t = Instant::now();
        let p = plan(&m, &c, &opts);
        let dp_ms = t.elapsed().as_secs_f64() * 1000.0;
        let (oracle, ratio) = if devices <= 10 {
            let t = Instant::now();
            let o = plan_exhaustive(&m, &c, &opts);
            let o_ms = t.elapsed().as_secs_f64() * 1000.0;
            let ratio = match (&p, &o) {
                (Ok(p), Ok(o)) => format!("{:.6}", o.predicted_tok_s / p.predicted_tok_s),
                (Err(_), Err(_)) => "both: no fit".into(),
                _ => "differ".into(),
            };
            (format!("{o_ms:.1}"), ratio)
        } else {
            ("-".into(), "-".into())
        };
        let (stages, tok_s) = match &p {
            Ok(p) => (p.stages.len().to_string(), format!("{:.2}", p.predicted_tok_s)),
            Err(e) => (format!("error: {e}"), "-".into()),
        };
        println!("{devices:>7} {hosts:>5} {name:<14} {dp_ms:>9.1}  {oracle:>15}  {ratio:>20}  {stages:>6}  {tok_s}");
    }
}
