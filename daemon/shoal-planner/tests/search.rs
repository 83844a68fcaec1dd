//! The scalable search against the exhaustive one it replaced (kept as an oracle,
//! `plan_exhaustive`), and at the scale it exists for:
//! - small random problems (pins, excludes, uneven layers included): the same
//!   predicted decode time within 1e-9 relative, the same placement and the same
//!   explanation whenever the placement is the same (a different one only on a tie);
//! - medium ones (9–10 devices on up to 8 hosts, where the search orders hosts by a
//!   heuristic beyond 6): within 2% of the oracle;
//! - a 405B-class model on 32 devices, which the old search (9 devices at most)
//!   could not place: a fitting plan over more than 9 devices.

mod common;

use common::{check_plan_is_valid, random_problem_sized, Rng};
use shoal_planner::plan::plan_exhaustive;
use shoal_planner::{plan, Cluster, Device, Link, ModelProfile, Options, Pin};
use shoal_types::LayerRange;

/// Both searches on one problem: the new one's decode ms over the oracle's (None
/// when neither places it), after checking they agree on what can be placed.
fn compare(model: &ModelProfile, cluster: &Cluster, opts: &Options, exact: bool) -> Option<f64> {
    let new = plan(model, cluster, opts);
    let old = plan_exhaustive(model, cluster, opts);
    match (new, old) {
        (Ok(n), Ok(o)) => {
            check_plan_is_valid(model, cluster, opts, &n);
            let (a, b) = (1000.0 / n.predicted_tok_s, 1000.0 / o.predicted_tok_s);
            assert!(a >= b * (1.0 - 1e-9), "better than the oracle? {a} < {b}: {n:#?}\n{o:#?}");
            if exact {
                assert!((a - b).abs() <= 1e-9 * b, "{a} ms, the oracle {b}: {n:#?}\n{o:#?}\n{model:?}\n{cluster:#?}");
                if n.stages == o.stages {
                    assert_eq!(n.explanation, o.explanation, "{model:?}\n{cluster:#?}");
                    assert_eq!(n.replicas, o.replicas);
                }
            }
            Some(a / b)
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string());
            None
        }
        (n, o) => panic!("the search says {n:?}, the oracle {o:?}\n{model:?}\n{cluster:#?}"),
    }
}

/// A random pin: some device, some range on the period.
fn random_pin(r: &mut Rng, model: &ModelProfile, cluster: &Cluster) -> Pin {
    let units = u64::from(model.layers.div_ceil(model.period));
    let a = r.below(units);
    let b = a + 1 + r.below(units - a);
    let at = |u: u64| (u as u32 * model.period).min(model.layers);
    let d = &cluster.devices[r.below(cluster.devices.len() as u64) as usize];
    Pin { device: d.id.clone(), layers: LayerRange { start: at(a), end: at(b) } }
}

#[test]
fn the_search_matches_the_exhaustive_one_on_small_problems() {
    let mut r = Rng::from_state(0x5eed_0003);
    let (mut planned, mut pinned) = (0, 0);
    for _ in 0..1500 {
        let varied = r.below(2) == 0;
        let (model, cluster) = random_problem_sized(&mut r, 8, 3, 1, 5, varied);
        let mut opts = Options {
            sizing: shoal_planner::Sizing { context: 1024 << r.below(3), sessions: 1, chunk: 64 },
            ..Options::default()
        };
        if r.below(4) == 0 {
            opts.pins.push(random_pin(&mut r, &model, &cluster));
        }
        if r.below(6) == 0 {
            opts.exclude.push(cluster.devices[r.below(cluster.devices.len() as u64) as usize].id.clone());
        }
        if compare(&model, &cluster, &opts, true).is_some() {
            planned += 1;
            pinned += usize::from(!opts.pins.is_empty());
        }
    }
    eprintln!("{planned} small problems planned ({pinned} with a pin), all as the oracle");
    assert!(planned > 600 && pinned > 50, "too few problems had a plan: {planned} ({pinned} pinned)");
}

#[test]
fn the_search_is_within_two_percent_on_medium_problems() {
    let mut r = Rng::from_state(0x5eed_0004);
    let (mut planned, mut exact, mut worst) = (0, 0, 1.0f64);
    for _ in 0..24 {
        // Few units keep the oracle's chains (at most one device per unit) countable.
        let (model, cluster) = random_problem_sized(&mut r, 6, 8, 9, 10, true);
        let hosts = {
            let mut h: Vec<&str> = cluster.devices.iter().map(|d| d.host.as_str()).collect();
            h.sort_unstable();
            h.dedup();
            h.len()
        };
        let opts = Options::default();
        // Up to 6 hosts every host order is searched: exact there too.
        if let Some(ratio) = compare(&model, &cluster, &opts, hosts <= 6) {
            planned += 1;
            exact += usize::from(ratio <= 1.0 + 1e-9);
            worst = worst.max(ratio);
            assert!(ratio <= 1.02, "{ratio}: more than 2% slower than the oracle\n{model:?}\n{cluster:#?}");
        }
    }
    eprintln!("{planned} medium problems planned, {exact} as fast as the oracle, the worst at {worst:.4}×");
    assert!(planned >= 12, "too few medium problems had a plan: {planned}");
}

const GB: u64 = 1_000_000_000;

/// 8 hosts, each a CPU with 16 GB and three 12 GB GPUs, on a wired LAN.
fn home_of_32() -> Cluster {
    let mut devices = Vec::new();
    let mut links = Vec::new();
    for h in 0..8 {
        let host = format!("pc{h}");
        let device = |id: String, memory_bytes: u64, ms_per_layer: f64, head_ms: f64| Device {
            id,
            host: host.clone(),
            memory_bytes,
            ms_per_layer,
            prefill_ms_per_layer_token: None,
            head_ms,
            wake_ms: 0.3,
            keepalive: false,
            estimated: false,
            offload: false,
        };
        devices.push(device(format!("{host}/cpu"), 16 * GB, 8.0 + f64::from(h) / 4.0, 20.0));
        for g in 0..3 {
            devices.push(device(format!("{host}/gpu{g}"), 12 * GB, 0.4 + f64::from(h * 3 + g) / 40.0, 1.5));
        }
        for other in 0..h {
            let ms_per_frame = 0.4 + f64::from((h + other) % 3) / 10.0;
            links.push(Link { hosts: [format!("pc{other}"), host.clone()], ms_per_frame, mbit_per_s: None });
        }
    }
    Cluster { devices, links }
}

#[test]
fn a_405b_model_plans_on_32_devices() {
    // Llama-3.1-405B-like at ~4.5 bits per weight: 126 blocks of 1.93 GB, 243 GB in
    // all. The 9 devices with the most memory (the old search's limit) hold 140 GB.
    let model = ModelProfile {
        layers: 126,
        layer_bytes: vec![1_930_000_000; 126],
        embed_bytes: 1_180_000_000,
        head_bytes: 1_180_000_000,
        tied_embeddings: false,
        other_bytes: 1 << 20,
        n_embd: 16384,
        n_vocab: 128_256,
        n_ff: 53248,
        period: 1,
        sliding_window: false,
        refused_stage_layers: Vec::new(),
        kv_bytes_per_token_per_layer: 4096,
    };
    let cluster = home_of_32();
    assert_eq!(cluster.devices.len(), 32);
    let opts = Options::default();
    let p = plan(&model, &cluster, &opts).expect("the cluster has room for the model");
    check_plan_is_valid(&model, &cluster, &opts, &p);
    assert!(p.stages.len() > 9, "a 405B model needs more than 9 of these devices: {p:#?}");
    let weights: u64 = model.layer_bytes.iter().sum::<u64>() + model.embed_bytes + model.head_bytes;
    let held: u64 = p.stages.iter().map(|s| s.memory_bytes).sum();
    assert!(held >= weights, "the stages hold {held} bytes, the weights alone are {weights}");
    assert!(p.explanation.iter().all(|s| !s.contains("not considered")), "{:#?}", p.explanation);
    // The GPUs are far faster: every GPU is used before a CPU is.
    let gpus = p.stages.iter().filter(|s| s.device.contains("gpu")).count();
    assert_eq!(gpus, 24, "{:#?}", p.stages);
}
