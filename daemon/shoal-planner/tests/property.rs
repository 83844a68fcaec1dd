//! Property tests over random clusters (a seeded generator: reproducible):
//! - a plan never exceeds any device's memory, covers every layer once in order, puts
//!   boundaries on the period and keeps each host's devices adjacent;
//! - no placement the planner considered is faster (by its own model) than its pick;
//! - on small problems, no placement at all is: every chain and every split of the
//!   layers is tried by brute force through `predict`.

mod common;

use common::{check_plan_is_valid, random_problem, Rng};
use shoal_planner::plan::considered;
use shoal_planner::{plan, predict, Options, Pin};
use shoal_types::LayerRange;

#[test]
fn plans_fit_and_nothing_considered_is_faster() {
    let mut r = Rng::from_state(0x5eed_0001);
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
    let mut r = Rng::from_state(0x5eed_0002);
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
