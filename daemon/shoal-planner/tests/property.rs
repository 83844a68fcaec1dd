//! Property tests over random clusters (a seeded generator: reproducible):
//! - a plan never exceeds any device's memory, covers every layer once in order, puts
//!   boundaries on the period and keeps each host's devices adjacent;
//! - no placement the planner considered is faster (by its own model) than its pick;
//! - on small problems, no placement at all is: every chain and every split of the
//!   layers is tried by brute force through `predict`.

use shoal_planner::plan::considered;
use shoal_planner::{plan, predict, Cluster, Device, Link, ModelProfile, Options, Pin};
use shoal_types::LayerRange;

/// xorshift64*: small, deterministic, good enough to vary inputs.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn float(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const MB: u64 = 1 << 20;

fn random_problem(r: &mut Rng, max_units: u64) -> (ModelProfile, Cluster) {
    let period = [1, 1, 2, 6][r.below(4) as usize];
    let layers = (1 + r.below(max_units)) as u32 * period - if period > 1 && r.below(3) == 0 { 1 } else { 0 };
    let layer_mb = 20 + r.below(200);
    let model = ModelProfile {
        layers,
        layer_bytes: vec![layer_mb * MB; layers as usize],
        embed_bytes: r.below(300) * MB,
        head_bytes: r.below(300) * MB,
        tied_embeddings: false,
        other_bytes: r.below(10) * MB,
        n_embd: 512 << r.below(4),
        n_vocab: 32000,
        n_ff: 2048,
        period,
        kv_bytes_per_token_per_layer: 1024 * (1 + r.below(8)),
    };
    let hosts = 1 + r.below(3);
    let n_dev = 1 + r.below(4);
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

fn check_plan_is_valid(model: &ModelProfile, cluster: &Cluster, opts: &Options, p: &shoal_planner::Plan) {
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

#[test]
fn plans_fit_and_nothing_considered_is_faster() {
    let mut r = Rng(0x5eed_0001);
    let mut planned = 0;
    for _ in 0..1000 {
        let (model, cluster) = random_problem(&mut r, 12);
        let opts =
            Options { sizing: shoal_planner::Sizing { context: 2048, sessions: 1, chunk: 64 }, ..Options::default() };
        let Ok(p) = plan(&model, &cluster, &opts) else { continue };
        planned += 1;
        check_plan_is_valid(&model, &cluster, &opts, &p);
        let ms = 1000.0 / p.predicted_tok_s;
        for (stages, other) in considered(&model, &cluster, &opts).unwrap() {
            assert!(ms <= other + 1e-9, "{stages:?} predicts {other} ms < the plan's {ms}: {p:#?}");
        }
    }
    eprintln!("{planned} random problems planned");
    assert!(planned > 400, "too few random problems had a plan: {planned}");
}

/// Every split of `units` into `k` positive parts.
fn compositions(units: u32, k: usize) -> Vec<Vec<u32>> {
    if k == 1 {
        return vec![vec![units]];
    }
    (1..units)
        .flat_map(|first| {
            compositions(units - first, k - 1).into_iter().map(move |mut rest| {
                rest.insert(0, first);
                rest
            })
        })
        .collect()
}

fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    (0..items.len())
        .flat_map(|i| {
            let mut rest = items.to_vec();
            let x = rest.remove(i);
            permutations(&rest).into_iter().map(move |mut p| {
                p.insert(0, x);
                p
            })
        })
        .collect()
}

#[test]
fn on_small_problems_no_placement_at_all_is_faster() {
    let mut r = Rng(0x5eed_0002);
    let mut compared = 0;
    for _ in 0..400 {
        let (model, cluster) = random_problem(&mut r, 6);
        let opts = Options::default();
        let best = plan(&model, &cluster, &opts).ok();
        let units = model.layers.div_ceil(model.period);
        let n = cluster.devices.len();
        let mut brute: Option<f64> = None;
        let mut brute_at: Vec<Pin> = Vec::new();
        for mask in 1u32..(1 << n) {
            let subset: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
            if subset.len() as u32 > units {
                continue;
            }
            for order in permutations(&subset) {
                // One host's devices adjacent, as the planner requires.
                let hosts: Vec<&str> = order.iter().map(|&i| cluster.devices[i].host.as_str()).collect();
                let mut seen: Vec<&str> = Vec::new();
                if hosts.iter().any(|h| {
                    let split = seen.last() != Some(h) && seen.contains(h);
                    seen.push(h);
                    split
                }) {
                    continue;
                }
                for parts in compositions(units, order.len()) {
                    let mut at = 0;
                    let stages: Vec<Pin> = order
                        .iter()
                        .zip(&parts)
                        .map(|(&d, &u)| {
                            let start = at;
                            at = ((start / model.period + u) * model.period).min(model.layers);
                            Pin { device: cluster.devices[d].id.clone(), layers: LayerRange { start, end: at } }
                        })
                        .collect();
                    let p = predict(&model, &cluster, &stages, &opts).unwrap();
                    if p.fits {
                        let ms = 1000.0 / p.predicted_tok_s;
                        if brute.is_none_or(|b| ms < b) {
                            brute = Some(ms);
                            brute_at = stages.clone();
                        }
                    }
                }
            }
        }
        match (best, brute) {
            (Some(p), Some(b)) => {
                compared += 1;
                let ms = 1000.0 / p.predicted_tok_s;
                assert!(ms <= b + 1e-9, "brute force found {b} ms ({brute_at:?}), the planner {ms}: {p:#?}");
            }
            (None, None) => {}
            (Some(p), None) => panic!("the planner placed what brute force cannot: {p:#?}"),
            (None, Some(b)) => panic!(
                "brute force found a placement ({b} ms, {brute_at:?}) the planner missed: {:?}\n{model:?}\n{cluster:#?}",
                plan(&model, &cluster, &opts)
            ),
        }
    }
    eprintln!("{compared} random problems compared with brute force");
    assert!(compared > 150, "too few comparable problems: {compared}");
}
