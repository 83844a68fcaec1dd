//! `shoal-lab bench faults`: three stages on namespace hosts and one long greedy
//! generation through a seeded schedule of mixed faults, one to three seconds apart:
//! links cut for 1-4.5 s, 10% loss for 3 s, SIGKILL of a stage (the coordinator's
//! too: the client resumes the generation) and a restart 0.2-2 s later, sometimes
//! while the stage's link is still down, and a stage stopped for 5-20 s (SIGSTOP, a
//! laptop's lid) then continued. Prints
//! each fault and the time from its healing (the link back, the loss gone, the
//! restarted stage serving) to the next token, per kind, and checks the tokens and
//! logits digest against the unsplit run. The suite runs it on several seeds.

use super::{json_of, median, GenOutput};
use crate::lab::Lab;
use anyhow::{bail, Result};
use clap::Args;
use shoal_testnet::Rng;
use shoal_types::LayerRange;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct FaultsArgs {
    /// The GGUF model file [default: SmolLM2-135M from the test models].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Seeds of the fault schedules, one generation each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    seeds: Vec<u64>,
    /// Faults per generation.
    #[arg(long, default_value_t = 8)]
    faults: usize,
    /// Tokens generated.
    #[arg(short = 'n', long, default_value_t = 700)]
    tokens: usize,
    /// Let each fault heal fully (the next token has come) before the pause before the
    /// next one, so that each figure is one fault's own; by default faults come 1-3 s
    /// apart whatever the recovery, and one often lands while the ring recovers from
    /// the one before.
    #[arg(long)]
    settle: bool,
    /// Only these kinds of fault (comma-separated: cut, loss, restart,
    /// coordinator-restart, restart-link-down, lid): the seed's schedule with the
    /// other kinds drawn again.
    #[arg(long, value_delimiter = ',', value_parser = ["cut", "loss", "restart", "coordinator-restart", "restart-link-down", "lid"])]
    only: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The setup: SmolLM2 at 0-9 / 9-21 / 21-30, context 2048, chunk 128.
const SPLIT: [(u32, u32); 3] = [(0, 9), (9, 21), (21, 30)];
const CHUNK: u32 = 128;
const CONTEXT: u32 = 2048;
const PROMPT: &str = "Write a long and detailed story about a lighthouse keeper and the ships she guides.";

/// One fault of a schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// Host `k`'s link down for this long.
    Cut(usize, Duration),
    /// 10% of host `k`'s packets lost for 3 s.
    Loss(usize),
    /// Stage `k` SIGKILLed, started again after this long.
    Restart(usize, Duration),
    /// Stage `k` SIGKILLed while its link is down; started again after the first
    /// duration, its link up after the second.
    RestartWhileDown(usize, Duration, Duration),
    /// Stage `k`'s process stopped (SIGSTOP: a laptop's lid closed) for this long, then
    /// continued with its sockets and timers stale.
    Lid(usize, Duration),
}

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::Cut(..) => "link cut",
            Fault::Loss(..) => "10% loss",
            Fault::Restart(0, _) => "coordinator restart",
            Fault::Restart(..) => "restart",
            Fault::RestartWhileDown(..) => "restart, link down",
            Fault::Lid(..) => "lid closed",
        }
    }

    /// The kind's name for `--only`.
    fn slug(&self) -> &'static str {
        match self {
            Fault::Cut(..) => "cut",
            Fault::Loss(..) => "loss",
            Fault::Restart(0, _) => "coordinator-restart",
            Fault::Restart(..) => "restart",
            Fault::RestartWhileDown(..) => "restart-link-down",
            Fault::Lid(..) => "lid",
        }
    }

    fn describe(&self) -> String {
        match *self {
            Fault::Cut(k, d) => format!("host {k}'s link down {:.1} s", d.as_secs_f64()),
            Fault::Loss(k) => format!("10% loss on host {k} for 3 s"),
            Fault::Restart(k, d) => format!("SIGKILL stage {k}, restart after {:.1} s", d.as_secs_f64()),
            Fault::RestartWhileDown(k, r, u) => format!(
                "host {k}'s link down, SIGKILL stage {k}, restart after {:.1} s, link up {:.1} s later",
                r.as_secs_f64(),
                u.as_secs_f64()
            ),
            Fault::Lid(k, d) => {
                format!("SIGSTOP stage {k} (a laptop's lid) for {:.1} s, then SIGCONT", d.as_secs_f64())
            }
        }
    }
}

/// A pause or duration of `lo..hi` ms.
fn ms(rng: &mut Rng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(lo + rng.below(hi - lo))
}

/// The faults of seed `seed`, with the pause before each; only those of the kinds in
/// `only` (by [`Fault::slug`]) where it is not empty.
fn schedule(seed: u64, n: usize, only: &[String]) -> Vec<(Duration, Fault)> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    while out.len() < n {
        let (pause, fault) = draw(&mut rng);
        if only.is_empty() || only.iter().any(|k| k == fault.slug()) {
            out.push((pause, fault));
        }
    }
    out
}

/// The next fault of a schedule, with the pause before it.
fn draw(rng: &mut Rng) -> (Duration, Fault) {
    let pause = ms(rng, 1000, 3000);
    let fault = match rng.below(5) {
        0 => Fault::Cut(rng.below(3) as usize, ms(rng, 1000, 4500)),
        1 => Fault::Loss(rng.below(3) as usize),
        // Any stage; the coordinator's restart ends the client's stream, and
        // `shoal generate` resumes the generation from its tokens (as the API does).
        2 => Fault::Restart(rng.below(3) as usize, ms(rng, 200, 2000)),
        3 => Fault::RestartWhileDown(1 + rng.below(2) as usize, ms(rng, 200, 1500), ms(rng, 500, 2500)),
        // The middle stage or the tail. (A coordinator's host that sleeps stops its
        // clients too, and a stop longer than QUIC's 10 s idle timeout ends their
        // connections: the API's resumption is for that.)
        _ => Fault::Lid(1 + rng.below(2) as usize, ms(rng, 5000, 20000)),
    };
    (pause, fault)
}

/// What one generation under one schedule gave.
#[derive(serde::Serialize)]
struct Run {
    seed: u64,
    /// Each fault applied: what, and the time from its healing to the next token
    /// (none where the generation ended first).
    faults: Vec<(String, &'static str, Option<f64>)>,
    tokens: usize,
    identical: bool,
    error: Option<String>,
}

pub fn faults(a: FaultsArgs) -> Result<()> {
    let model = a.model.clone().unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let stages: Vec<LayerRange> = SPLIT.iter().map(|&(s, e)| LayerRange::new(s, e)).collect();
    let args = ["--prompt", PROMPT, "-n", &a.tokens.to_string(), "--ignore-eos", "--json"];
    let mut run = Command::new(shoal::shoal_exe()?);
    run.arg("run").arg("--model").arg(&model);
    run.args(["--chunk", &CHUNK.to_string(), "--ctx", &CONTEXT.to_string()]).args(args);
    let unsplit: GenOutput = json_of(run, "run")?;
    let mut runs = Vec::new();
    for &seed in &a.seeds {
        runs.push(one(&model, &stages, seed, (a.faults, &a.only), a.settle, &args, &unsplit)?);
    }
    // Healing → next token, by kind, over every run.
    let mut by_kind: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &runs {
        for (_, kind, t) in &r.faults {
            by_kind.entry(kind).or_default().extend(t);
        }
    }
    if a.json {
        let kinds: serde_json::Map<String, serde_json::Value> = by_kind
            .iter()
            .map(|(k, v)| {
                let mut v = v.clone();
                let max = v.iter().copied().fold(0.0, f64::max);
                (k.to_string(), serde_json::json!({"n": v.len(), "p50_s": median(&mut v), "max_s": max}))
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"runs": runs, "healed_to_next_token": kinds}))?
        );
    } else {
        println!(
            "bench faults: {} split {SPLIT:?} on 3 namespace hosts, {} tokens, {} faults per run{}",
            model.display(),
            a.tokens,
            a.faults,
            if a.settle { ", each healed before the next" } else { ", 1-3 s apart" }
        );
        for r in &runs {
            println!(
                "seed {}: {} tokens, identical to unsplit: {}",
                r.seed,
                r.tokens,
                if r.identical { "yes" } else { "NO" }
            );
            if let Some(e) = &r.error {
                println!("  failed: {e}");
            }
            for (what, _, t) in &r.faults {
                let t = t.map_or("(ended before)".to_string(), |t| format!("{t:.2} s"));
                println!("  {what:<76} healed → next token {t}");
            }
        }
        println!("{:<20} {:>6} {:>8} {:>8}", "healed → next token", "faults", "p50 s", "max s");
        for (kind, v) in &by_kind {
            let max = v.iter().copied().fold(0.0, f64::max);
            println!("{kind:<20} {:>6} {:>8.2} {max:>8.2}", v.len(), median(&mut v.clone()));
        }
    }
    if let Some(r) = runs.iter().find(|r| !r.identical) {
        bail!(
            "seed {}: the output differs from the unsplit run ({})",
            r.seed,
            r.error.as_deref().unwrap_or("exact count")
        );
    }
    Ok(())
}

/// One generation of `args` through the split on namespace hosts under seed `seed`'s
/// schedule.
fn one(
    model: &std::path::Path,
    stages: &[LayerRange],
    seed: u64,
    (n_faults, only): (usize, &[String]),
    settle: bool,
    args: &[&str],
    unsplit: &GenOutput,
) -> Result<Run> {
    let mut lab = Lab::start("flt", model, stages, CHUNK, CONTEXT, &shoal_net::Impairment::default(), &[])?;
    let crate::lab::Generation { child: mut gen, tokens: rx, errors } = lab.spawn_generation(args)?;
    // Token arrival times, as they come.
    let mut arrivals: Vec<Instant> = Vec::new();
    let drain = |arrivals: &mut Vec<Instant>| arrivals.extend(rx.try_iter().map(|(_, t)| t));
    // Under way first: the faults hit decode steps, not the prompt.
    let t0 = Instant::now();
    while arrivals.len() < 40 {
        arrivals.extend(rx.recv_timeout(Duration::from_secs(120)).ok().map(|(_, t)| t));
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("seed {seed}: the generation did not get under way");
        }
    }
    let mut applied: Vec<(Fault, Instant)> = Vec::new();
    for (pause, fault) in schedule(seed, n_faults, only) {
        std::thread::sleep(pause);
        drain(&mut arrivals);
        if gen.try_wait()?.is_some() {
            break;
        }
        let healed = match fault {
            Fault::Cut(k, d) => {
                lab.net.link(k, false)?;
                std::thread::sleep(d);
                lab.net.link(k, true)?;
                Instant::now()
            }
            Fault::Loss(k) => {
                lab.net.loss(k, 10)?;
                std::thread::sleep(Duration::from_secs(3));
                lab.net.loss(k, 0)?;
                Instant::now()
            }
            Fault::Restart(k, d) => {
                lab.kill_stage(k)?;
                std::thread::sleep(d);
                lab.start_stage(k)?;
                Instant::now()
            }
            Fault::RestartWhileDown(k, r, u) => {
                lab.net.link(k, false)?;
                lab.kill_stage(k)?;
                std::thread::sleep(r);
                lab.start_stage(k)?;
                std::thread::sleep(u);
                lab.net.link(k, true)?;
                Instant::now()
            }
            Fault::Lid(k, d) => {
                lab.freeze_stage(k, true)?;
                std::thread::sleep(d);
                lab.freeze_stage(k, false)?;
                Instant::now()
            }
        };
        applied.push((fault, healed));
        if settle {
            // Until a token comes after the healing (or the generation ends).
            while arrivals.last().is_none_or(|t| *t < healed) && gen.try_wait()?.is_none() {
                arrivals.extend(rx.recv_timeout(Duration::from_millis(50)).ok().map(|(_, t)| t));
            }
        }
    }
    let out = gen.wait_with_output()?;
    drain(&mut arrivals);
    let error = (!out.status.success()).then(|| errors.join().unwrap_or_default());
    let piped: Option<GenOutput> = out.status.success().then(|| serde_json::from_slice(&out.stdout)).transpose()?;
    let identical =
        piped.as_ref().is_some_and(|p| p.tokens == unsplit.tokens && p.logits_digest == unsplit.logits_digest);
    let faults = applied
        .iter()
        .map(|(f, healed)| {
            let next = arrivals.iter().find(|t| *t >= healed).map(|t| t.duration_since(*healed).as_secs_f64());
            (f.describe(), f.kind(), next)
        })
        .collect();
    Ok(Run { seed, faults, tokens: piped.map_or(0, |p| p.tokens.len()), identical, error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_depends_on_its_seed_alone_and_mixes_every_kind() {
        assert_eq!(schedule(7, 12, &[]), schedule(7, 12, &[]));
        assert_ne!(schedule(7, 12, &[]), schedule(8, 12, &[]));
        let kinds: std::collections::BTreeSet<&str> =
            (1..5).flat_map(|s| schedule(s, 8, &[])).map(|(_, f)| f.kind()).collect();
        assert_eq!(kinds.len(), 6, "{kinds:?}");
        // `--only` keeps the kinds named, in the seed's order.
        let only = ["restart-link-down".to_string(), "lid".to_string()];
        let picked = schedule(7, 6, &only);
        assert_eq!(picked.len(), 6);
        assert!(picked.iter().all(|(_, f)| matches!(f, Fault::RestartWhileDown(..) | Fault::Lid(..))), "{picked:?}");
        let unfiltered: Vec<_> =
            schedule(7, 60, &[]).into_iter().filter(|(_, f)| only.iter().any(|k| k == f.slug())).collect();
        assert_eq!(picked[..], unfiltered[..6]);
        for (pause, f) in schedule(3, 50, &[]) {
            assert!(pause >= Duration::from_secs(1) && pause < Duration::from_secs(3));
            match f {
                Fault::Restart(k, _) => assert!(k < 3, "{f:?}"),
                Fault::RestartWhileDown(k, ..) => assert!(k == 1 || k == 2, "{f:?}"),
                Fault::Cut(k, d) => assert!(k < 3 && d < Duration::from_millis(4500), "{f:?}"),
                Fault::Loss(k) => assert!(k < 3),
                Fault::Lid(k, d) => {
                    assert!((k == 1 || k == 2) && d >= Duration::from_secs(5) && d < Duration::from_secs(20), "{f:?}")
                }
            }
        }
    }
}
