//! Choosing and predicting placements.
//!
//! Decode time per token is modelled as (DESIGN, "Placement model"):
//! Σ over stages (its layers × the device's ms per layer) + the tail device's LM-head
//! time + Σ over the hops a token crosses, including the tail → coordinator return
//! (the link's time per frame + the receiving device's wake-up cost). A stage's
//! memory limit depends on its role only (stage 0 holds the embedding, the tail the
//! LM head; a middle stage is bounded by the model's biggest units), so the best
//! chain and split are found by a dynamic program over the layers placed so far, with
//! one host's devices adjacent and boundaries on the architecture's period
//! ([`crate::search`]); it scales to tens of devices. The exhaustive search it
//! replaced (every ordered chain, each filled greedily) stays as the tests' oracle
//! ([`plan_exhaustive`], [`considered`]).
//!
//! The explanation asks the search further questions: the best placement without a
//! device (is it needed for memory?), with a device (what would using it cost?), and
//! on each host alone (replicas).

use crate::model::{ModelProfile, Sizing};
use crate::profile::{Cluster, Device};
use crate::search::{self, Constraint};
use serde::Serialize;
use shoal_types::LayerRange;
use std::collections::BTreeMap;

/// What the planner is asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Context, sessions and chunk size.
    pub sizing: Sizing,
    /// Memory kept free on every device for the OS, drivers and the daemon itself.
    pub reserve_bytes: u64,
    /// Layer ranges that must go on given devices.
    pub pins: Vec<Pin>,
    /// Devices (by id) or hosts (by name) not to use.
    pub exclude: Vec<String>,
    /// Prompt length for the time-to-first-token prediction.
    pub prompt_tokens: u32,
}

/// Default memory reserve per device.
pub const DEFAULT_RESERVE: u64 = 512 << 20;

impl Default for Options {
    fn default() -> Self {
        Options {
            sizing: Sizing { context: 4096, sessions: 1, chunk: 128 },
            reserve_bytes: DEFAULT_RESERVE,
            pins: Vec::new(),
            exclude: Vec::new(),
            prompt_tokens: 1000,
        }
    }
}

/// "Layers `layers` on device `device`."
#[derive(Clone, Debug, PartialEq)]
pub struct Pin {
    /// Device id.
    pub device: String,
    /// The layers it must hold, exactly.
    pub layers: LayerRange,
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannedStage {
    /// Device id.
    pub device: String,
    /// Its host.
    pub host: String,
    /// First layer.
    pub first: u32,
    /// One past the last layer.
    pub last: u32,
    /// Memory the stage takes (weights, KV, compute).
    pub memory_bytes: u64,
    /// Compute time per decoded token, ms (with the LM head on the tail).
    pub ms_per_token: f64,
}

/// A placement with its predictions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Ordered stages: stage 0 (the coordinator) first.
    pub stages: Vec<PlannedStage>,
    /// Predicted decode speed of one session.
    pub predicted_tok_s: f64,
    /// Predicted time to first token for `prompt_tokens`.
    pub predicted_ttft_s: f64,
    /// The prompt length of `predicted_ttft_s`.
    pub prompt_tokens: u32,
    /// Memory per device used.
    pub memory_bytes: BTreeMap<String, u64>,
    /// Whether every stage fits its device (always true for a chosen plan).
    pub fits: bool,
    /// Why this placement, in sentences.
    pub explanation: Vec<String>,
    /// When several hosts can each hold the whole model: the best placement on each,
    /// to run side by side for concurrent users.
    pub replicas: Vec<Replica>,
}

/// One independent copy of the model on one host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Replica {
    /// The host.
    pub host: String,
    /// Its stages (its own devices only).
    pub stages: Vec<PlannedStage>,
    /// Its predicted decode speed.
    pub predicted_tok_s: f64,
}

/// Why there is no plan.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    /// No device left to place on.
    #[error("no devices to place on{0}")]
    NoDevices(String),
    /// The devices together lack memory.
    #[error("the model does not fit: about {} more is needed ({detail})", fmt_size(*missing_bytes))]
    DoesNotFit {
        /// Bytes missing (approximately: layers that found no room, with their KV).
        missing_bytes: u64,
        /// What was tried.
        detail: String,
    },
    /// A pin is malformed or cannot be honoured.
    #[error("pin refused: {0}")]
    Pin(String),
    /// A given placement is malformed.
    #[error("placement refused: {0}")]
    Placement(String),
}

/// Bytes for people, as every Shoal output prints them.
pub use shoal_types::fmt_size;

/// Ordered devices and their layer boundaries: `bounds[i]..bounds[i+1]` on `chain[i]`.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub(crate) chain: Vec<usize>,
    pub(crate) bounds: Vec<u32>,
    pub(crate) decode_ms: f64,
    pub(crate) hosts: usize,
}

/// The planner's view of one problem.
pub(crate) struct Problem<'a> {
    pub(crate) model: &'a ModelProfile,
    pub(crate) devices: Vec<&'a Device>,
    pub(crate) cluster: &'a Cluster,
    pub(crate) opts: &'a Options,
    /// Units of `period` layers (the last may be shorter).
    pub(crate) units: u32,
    /// Each device's capacity in units, by role: `caps[d][first as usize | (tail as usize) << 1]`.
    caps: Vec<[u32; 4]>,
    /// The hosts, in order of their first device.
    pub(crate) hosts: Vec<&'a str>,
    /// Each device's host (an index into `hosts`).
    pub(crate) host_of: Vec<usize>,
    /// Each host's devices, in cluster order.
    pub(crate) host_devices: Vec<Vec<usize>>,
    /// One-way ms per decode frame between hosts (`link_ms[a][a]`: within a host).
    pub(crate) link_ms: Vec<Vec<f64>>,
}

impl<'a> Problem<'a> {
    fn new(model: &'a ModelProfile, devices: Vec<&'a Device>, cluster: &'a Cluster, opts: &'a Options) -> Self {
        let units = model.layers.div_ceil(model.period);
        let mut hosts: Vec<&str> = Vec::new();
        let mut host_of = Vec::with_capacity(devices.len());
        let mut host_devices: Vec<Vec<usize>> = Vec::new();
        for (d, dev) in devices.iter().enumerate() {
            let h = match hosts.iter().position(|h| *h == dev.host) {
                Some(h) => h,
                None => {
                    hosts.push(&dev.host);
                    host_devices.push(Vec::new());
                    hosts.len() - 1
                }
            };
            host_of.push(h);
            host_devices[h].push(d);
        }
        let link_ms = hosts.iter().map(|a| hosts.iter().map(|b| cluster.link(a, b).ms_per_frame).collect()).collect();
        let mut p =
            Problem { model, devices, cluster, opts, units, caps: Vec::new(), hosts, host_of, host_devices, link_ms };
        p.caps = (0..p.devices.len())
            .map(|d| std::array::from_fn(|role| p.compute_capacity(d, role & 1 != 0, role & 2 != 0)))
            .collect();
        p
    }

    pub(crate) fn unit_range(&self, first_unit: u32, n: u32) -> LayerRange {
        // In u64: `units × period` may pass u32::MAX by up to a period.
        let (p, layers) = (u64::from(self.model.period), u64::from(self.model.layers));
        let at = |u: u32| (u64::from(u) * p).min(layers) as u32;
        LayerRange { start: at(first_unit), end: at(first_unit.saturating_add(n)) }
    }

    pub(crate) fn usable(&self, d: usize) -> u64 {
        self.devices[d].memory_bytes.saturating_sub(self.opts.reserve_bytes)
    }

    /// Most units device `d` can hold as stage 0 (`first`), the tail, or a middle
    /// stage (see [`Problem::compute_capacity`]).
    pub(crate) fn capacity(&self, d: usize, first: bool, tail: bool) -> u32 {
        self.caps[d][usize::from(first) | usize::from(tail) << 1]
    }

    /// Stage 0's and the tail's layers are known (the first or last units), so their
    /// memory is exact; a middle stage's position depends on the stages before it, so
    /// the biggest units bound it: a chain filled by counts never overflows. Sums
    /// saturate: an absurd profile needs `u64::MAX` bytes and fits nowhere.
    fn compute_capacity(&self, d: usize, first: bool, tail: bool) -> u32 {
        let m = self.model;
        let usable = self.usable(d);
        let sum = |bytes: &[u64]| bytes.iter().fold(0u64, |a, &b| a.saturating_add(b));
        let fits =
            |bytes: u64, r: LayerRange| m.memory_of(bytes, r.len(), first, tail, &self.opts.sizing).total() <= usable;
        if first && tail {
            // One stage holds everything, or nothing.
            let r = self.unit_range(0, self.units);
            return if fits(sum(&m.layer_bytes), r) { self.units } else { 0 };
        }
        let unit_bytes: Vec<u64> = m.layer_bytes.chunks(m.period as usize).map(sum).collect();
        // Units in the order a stage of this role takes them: from the front (stage
        // 0), from the back (the tail), or the biggest first (a middle stage).
        let mut order: Vec<u32> = (0..self.units).collect();
        if tail {
            order.reverse();
        } else if !first {
            order.sort_by(|&a, &b| unit_bytes[b as usize].cmp(&unit_bytes[a as usize]).then(a.cmp(&b)));
        }
        let (mut bytes, mut layers) = (0u64, 0u32);
        let mut best = 0;
        for (n, &u) in order.iter().enumerate() {
            bytes = bytes.saturating_add(unit_bytes[u as usize]);
            // A middle stage may hold n whole units wherever it sits: n periods of KV.
            layers = if first || tail {
                layers + self.unit_range(u, 1).len()
            } else {
                self.unit_range(0, n as u32 + 1).len()
            };
            if !fits(bytes, LayerRange { start: 0, end: layers }) {
                break;
            }
            best = n as u32 + 1;
        }
        best
    }

    /// Boundaries `bounds` for `chain` give every stage some layers, a size llama.cpp
    /// reads right (`ModelProfile::refused_stage_layers`), a pinned device exactly its
    /// pinned layers, and every device a stage that fits its memory.
    fn bounds_hold(&self, chain: &[usize], bounds: &[u32], pins: &[(usize, u32, u32)]) -> bool {
        chain.iter().enumerate().all(|(i, &d)| {
            let layers = LayerRange { start: bounds[i], end: bounds[i + 1] };
            let pinned = pins.iter().find(|pin| pin.0 == d).map(|pin| self.unit_range(pin.1, pin.2 - pin.1));
            !layers.is_empty()
                && !self.model.refused_stage_layers.contains(&layers.len())
                && pinned.is_none_or(|r| r == layers)
                && self.model.stage_memory(layers, &self.opts.sizing).total() <= self.usable(d)
        })
    }

    /// Predicted decode ms per token, and the per-stage compute ms.
    fn decode_ms(&self, chain: &[usize], bounds: &[u32]) -> (f64, Vec<f64>) {
        let mut stage_ms = Vec::with_capacity(chain.len());
        for (i, &d) in chain.iter().enumerate() {
            let dev = self.devices[d];
            let mut ms = f64::from(bounds[i + 1] - bounds[i]) * dev.ms_per_layer;
            if i + 1 == chain.len() {
                ms += dev.head_ms;
            }
            stage_ms.push(ms);
        }
        let mut total: f64 = stage_ms.iter().sum();
        if chain.len() > 1 {
            for i in 0..chain.len() {
                let (from, to) = (self.devices[chain[i]], self.devices[chain[(i + 1) % chain.len()]]);
                total += self.cluster.link(&from.host, &to.host).ms_per_frame + to.wake();
            }
        }
        (total, stage_ms)
    }

    /// Predicted time to first token, seconds: the prompt goes through in chunks that
    /// overlap across stages, so after the first chunk has crossed the pipeline each
    /// further chunk costs the slowest stage (or hop).
    fn ttft_s(&self, chain: &[usize], bounds: &[u32]) -> f64 {
        let c = self.opts.sizing.chunk.max(1);
        let p = self.opts.prompt_tokens.max(1);
        let chunks = p.div_ceil(c);
        let per_chunk = f64::from(p) / f64::from(chunks);
        let bytes = self.model.frame_bytes(1) as f64 * per_chunk;
        let mut first_pass = 0.0;
        let mut slowest: f64 = 0.0;
        for (i, &d) in chain.iter().enumerate() {
            let dev = self.devices[d];
            let compute = f64::from(bounds[i + 1] - bounds[i]) * per_chunk * dev.prefill_ms();
            first_pass += compute;
            slowest = slowest.max(compute);
            if i + 1 < chain.len() {
                let next = self.devices[chain[i + 1]];
                let link = self.cluster.link(&dev.host, &next.host);
                let extra = (bytes - self.model.frame_bytes(1) as f64).max(0.0) * 8.0 / (link.mbit_per_s * 1000.0);
                let hop = link.ms_per_frame + extra + next.wake();
                first_pass += hop;
                slowest = slowest.max(hop);
            }
        }
        let tail = self.devices[chain[chain.len() - 1]];
        let mut ms = first_pass + f64::from(chunks - 1) * slowest + tail.head_ms;
        if chain.len() > 1 {
            let head = self.devices[chain[0]];
            ms += self.cluster.link(&tail.host, &head.host).ms_per_frame + head.wake();
        }
        ms / 1000.0
    }

    /// A chain with its boundaries (in layers), scored by the model.
    pub(crate) fn candidate(&self, chain: Vec<usize>, bounds: Vec<u32>) -> Candidate {
        let (decode_ms, _) = self.decode_ms(&chain, &bounds);
        let mut hosts: Vec<usize> = chain.iter().map(|&d| self.host_of[d]).collect();
        hosts.dedup();
        Candidate { chain, bounds, decode_ms, hosts: hosts.len() }
    }

    fn stages(&self, chain: &[usize], bounds: &[u32]) -> Vec<PlannedStage> {
        let (_, stage_ms) = self.decode_ms(chain, bounds);
        chain
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let layers = LayerRange { start: bounds[i], end: bounds[i + 1] };
                PlannedStage {
                    device: self.devices[d].id.clone(),
                    host: self.devices[d].host.clone(),
                    first: layers.start,
                    last: layers.end,
                    memory_bytes: self.model.stage_memory(layers, &self.opts.sizing).total(),
                    ms_per_token: stage_ms[i],
                }
            })
            .collect()
    }

    fn to_plan(&self, c: &Candidate) -> Plan {
        let stages = self.stages(&c.chain, &c.bounds);
        let mut memory_bytes = BTreeMap::new();
        let mut fits = true;
        for (s, &d) in stages.iter().zip(&c.chain) {
            memory_bytes.insert(s.device.clone(), s.memory_bytes);
            fits &= s.memory_bytes <= self.usable(d);
        }
        Plan {
            stages,
            predicted_tok_s: 1000.0 / c.decode_ms,
            predicted_ttft_s: self.ttft_s(&c.chain, &c.bounds),
            prompt_tokens: self.opts.prompt_tokens,
            memory_bytes,
            fits,
            explanation: Vec::new(),
            replicas: Vec::new(),
        }
    }
}

/// Better: faster; on a tie, fewer hosts, then fewer stages.
fn better(a: &Candidate, b: &Candidate) -> bool {
    const EPS: f64 = 1e-9;
    if (a.decode_ms - b.decode_ms).abs() > EPS {
        return a.decode_ms < b.decode_ms;
    }
    (a.hosts, a.chain.len()) < (b.hosts, b.chain.len())
}

/// `a` is to be chosen over `b`: [`better`], and on a full tie the chain that comes
/// first in device order (the one the exhaustive search meets first), so that both
/// searches pick the same chain among equals.
pub(crate) fn preferred(a: &Candidate, b: &Candidate) -> bool {
    better(a, b) || (!better(b, a) && (a.hosts, a.chain.len()) == (b.hosts, b.chain.len()) && a.chain < b.chain)
}

/// `best`, or where one of its stages has a size llama.cpp would misread for this model
/// (`ModelProfile::refused_stage_layers`: DeepSeek's 26 and 27), the same chain with a
/// boundary moved by one or two periods so that no stage has such a size, every stage
/// still fits its device and pinned stages keep their layers. The search does not
/// know of these sizes (its capacities are "at most"); a nudge this small keeps its
/// choice otherwise.
fn avoid_refused_sizes(
    p: &Problem<'_>,
    best: Candidate,
    pins: &[(usize, u32, u32)],
    notes: &mut Vec<String>,
) -> Result<Candidate, PlanError> {
    let refused = &p.model.refused_stage_layers;
    let ok = |bounds: &[u32]| p.bounds_hold(&best.chain, bounds, pins);
    if refused.is_empty() || ok(&best.bounds) {
        return Ok(best);
    }
    let period = p.model.period;
    for step in [period, 2 * period] {
        for i in 1..best.bounds.len() - 1 {
            for b in [best.bounds[i].checked_add(step), best.bounds[i].checked_sub(step)].into_iter().flatten() {
                let mut bounds = best.bounds.clone();
                bounds[i] = b;
                if b < p.model.layers && ok(&bounds) {
                    notes.push(format!(
                        "Boundary {} moved to {b}: llama.cpp would take a stage of {:?} layers of this model for \
                         another variant of it.",
                        best.bounds[i], refused
                    ));
                    return Ok(p.candidate(best.chain.clone(), bounds));
                }
            }
        }
    }
    Err(PlanError::Placement(format!(
        "no placement found without a stage of {refused:?} layers, which llama.cpp would take for another variant \
         of this model"
    )))
}

/// Resolved pins: (device index, first unit, end unit).
type Pins = Vec<(usize, u32, u32)>;

/// Single-stream decode time a placement for several sessions may give up (a share of
/// the fastest's) to even out its stages. Measured speeds of like machines differ by a
/// few percent, so the fastest chain piles layers onto whichever measured faster; this
/// much lets those layers spread back without letting a fast GPU's layers go to a CPU.
pub const BALANCE_TOLERANCE: f64 = 0.02;

/// With several sessions the stages work on different sessions' tokens at once, so
/// the pipeline's throughput is set by its slowest stage, not by the sum the search
/// minimises (and a prompt's chunks flow at the slowest stage's pace too). Keeps
/// `best`'s chain and moves its boundaries one period at a time, towards a
/// neighbour of the slower stage, while that lowers the stages' times (slowest first,
/// compared in order), every stage still fits with a size llama.cpp reads right, no
/// pinned stage changes, and the single-stream decode time stays within
/// [`BALANCE_TOLERANCE`] of `best`'s. A placement for one session is left as found.
fn balance(p: &Problem<'_>, best: Candidate, pins: &[(usize, u32, u32)], notes: &mut Vec<String>) -> Candidate {
    if p.opts.sizing.sessions <= 1 || best.chain.len() < 2 || !best.decode_ms.is_finite() {
        return best;
    }
    let limit = best.decode_ms * (1.0 + BALANCE_TOLERANCE);
    let fits = |bounds: &[u32]| p.bounds_hold(&best.chain, bounds, pins);
    // The stages' times, slowest first: what a move must lower.
    let key = |bounds: &[u32]| {
        let mut ms = p.decode_ms(&best.chain, bounds).1;
        ms.sort_by(|a, b| b.total_cmp(a));
        ms
    };
    // `a` is lower than `b` at the first time that differs by more than float noise.
    let lower =
        |a: &[f64], b: &[f64]| a.iter().zip(b).find(|(x, y)| (*x - *y).abs() > 1e-9).is_some_and(|(x, y)| x < y);
    let (mut bounds, mut now) = (best.bounds.clone(), key(&best.bounds));
    // Each move lowers `now` in a strict order over finitely many bounds: this ends.
    loop {
        let mut next: Option<(Vec<u32>, Vec<f64>)> = None;
        for i in 1..bounds.len() - 1 {
            let moved = [bounds[i].checked_add(p.model.period), bounds[i].checked_sub(p.model.period)];
            for b in moved.into_iter().flatten() {
                if b <= bounds[i - 1] || b >= bounds[i + 1] {
                    continue;
                }
                let mut t = bounds.clone();
                t[i] = b;
                if !fits(&t) || p.decode_ms(&best.chain, &t).0 > limit {
                    continue;
                }
                let k = key(&t);
                if lower(&k, next.as_ref().map_or(&now, |n| &n.1)) {
                    next = Some((t, k));
                }
            }
        }
        match next {
            Some((t, k)) => (bounds, now) = (t, k),
            None => break,
        }
    }
    if bounds == best.bounds {
        return best;
    }
    let balanced = p.candidate(best.chain.clone(), bounds);
    let slowest = |c: &Candidate| p.decode_ms(&c.chain, &c.bounds).1.into_iter().fold(0.0, f64::max);
    notes.push(format!(
        "Layers evened out for {} sessions at once: the slowest stage takes {:.2} ms per token instead of {:.2} \
         (a pipeline serving several sessions runs at its slowest stage's pace), one session's decode {:+.2} ms.",
        p.opts.sizing.sessions,
        slowest(&balanced),
        slowest(&best),
        balanced.decode_ms - best.decode_ms
    ));
    balanced
}

/// How the best placement under a constraint is found: the scalable search, or the
/// exhaustive one kept as the tests' oracle. The explanation asks the same questions
/// of either ("the best without d", "the best with d", "the best on host h").
enum Search {
    Dp,
    /// Candidates by pins, computed once per pin set.
    Exhaustive(std::cell::RefCell<Vec<(Pins, Vec<Candidate>)>>),
}

impl Search {
    /// Whether anything fits under `c` (without pins).
    fn fits(&self, p: &Problem<'_>, c: &Constraint) -> bool {
        match self {
            Search::Dp => search::fits(p, c),
            Search::Exhaustive(_) => self.best(p, &[], c).is_some(),
        }
    }

    fn best(&self, p: &Problem<'_>, pins: &[(usize, u32, u32)], c: &Constraint) -> Option<Candidate> {
        match self {
            Search::Dp => search::best(p, pins, c),
            Search::Exhaustive(cache) => {
                let mut cache = cache.borrow_mut();
                let i = match cache.iter().position(|(k, _)| k == pins) {
                    Some(i) => i,
                    None => {
                        cache.push((pins.to_vec(), p.candidates(pins)));
                        cache.len() - 1
                    }
                };
                let ok = |x: &&Candidate| {
                    x.chain.iter().all(|&d| c.allowed[d]) && c.required.is_none_or(|r| x.chain.contains(&r))
                };
                cache[i]
                    .1
                    .iter()
                    .filter(ok)
                    .fold(None, |best: Option<&Candidate>, x| match best {
                        Some(b) if !preferred(x, b) => Some(b),
                        _ => Some(x),
                    })
                    .cloned()
            }
        }
    }
}

fn problem<'a>(
    model: &'a ModelProfile,
    cluster: &'a Cluster,
    opts: &'a Options,
) -> Result<(Problem<'a>, Vec<String>), PlanError> {
    let mut notes = Vec::new();
    if model.layers == 0 || model.period == 0 || model.layer_bytes.len() != model.layers as usize {
        return Err(PlanError::Placement("the model profile is inconsistent (layers, period, layer_bytes)".into()));
    }
    let devices: Vec<&Device> =
        cluster.devices.iter().filter(|d| !opts.exclude.iter().any(|e| e == &d.id || e == &d.host)).collect();
    for e in &opts.exclude {
        if cluster.devices.iter().any(|d| &d.id == e || &d.host == e) {
            notes.push(format!("{e} excluded as asked."));
        }
    }
    if devices.is_empty() {
        let why = if cluster.devices.is_empty() { "" } else { " (all excluded)" };
        return Err(PlanError::NoDevices(why.into()));
    }
    Ok((Problem::new(model, devices, cluster, opts), notes))
}

/// Pins as (device index, first unit, end unit), validated.
fn resolve_pins(p: &Problem<'_>) -> Result<Vec<(usize, u32, u32)>, PlanError> {
    let mut out: Vec<(usize, u32, u32)> = Vec::new();
    let period = p.model.period;
    for pin in &p.opts.pins {
        let r = pin.layers;
        if r.start >= r.end || r.end > p.model.layers {
            return Err(PlanError::Pin(format!(
                "layers {r} on {}: not a range within 0-{}",
                pin.device, p.model.layers
            )));
        }
        for b in [r.start, r.end] {
            if b % period != 0 && b != p.model.layers {
                return Err(PlanError::Pin(format!(
                    "layers {r} on {}: boundary {b} is not a multiple of the architecture's period {period}",
                    pin.device
                )));
            }
        }
        let Some(d) = p.devices.iter().position(|d| d.id == pin.device) else {
            let why = if p.cluster.devices.iter().any(|d| d.id == pin.device) {
                "is excluded"
            } else {
                "is not in the cluster"
            };
            return Err(PlanError::Pin(format!("layers {r} on {}: that device {why}", pin.device)));
        };
        let (a, b) = (r.start / period, r.end.div_ceil(period));
        if let Some(o) = out.iter().find(|o| o.1 < b && a < o.2 || o.0 == d) {
            return Err(PlanError::Pin(format!(
                "layers {r} on {} overlaps another pin (or the device is pinned twice: {})",
                pin.device, p.devices[o.0].id
            )));
        }
        out.push((d, a, b));
    }
    Ok(out)
}

/// The fastest placement of `model` on `cluster` that fits, with its predictions and
/// the reasons for it.
pub fn plan(model: &ModelProfile, cluster: &Cluster, opts: &Options) -> Result<Plan, PlanError> {
    plan_with(model, cluster, opts, &Search::Dp)
}

/// [`plan`] by the exhaustive search (every ordered chain, each filled greedily): the
/// oracle the tests hold the scalable search to. Its cost grows factorially with the
/// devices: for tests on small clusters only.
#[doc(hidden)]
pub fn plan_exhaustive(model: &ModelProfile, cluster: &Cluster, opts: &Options) -> Result<Plan, PlanError> {
    plan_with(model, cluster, opts, &Search::Exhaustive(Default::default()))
}

fn plan_with(model: &ModelProfile, cluster: &Cluster, opts: &Options, search: &Search) -> Result<Plan, PlanError> {
    let (p, mut notes) = problem(model, cluster, opts)?;
    let pins = resolve_pins(&p)?;
    let all = Constraint::all(p.devices.len());
    let Some(mut best) = search.best(&p, &pins, &all) else {
        return Err(no_fit(&p, &pins, search));
    };
    // "The best placement with d" for each device left out. Past the hosts whose
    // every order is searched, the search is a heuristic and the one with d may find
    // a better placement than the first pass: then that one is the plan.
    let with: Vec<Option<Candidate>> = loop {
        let with: Vec<Option<Candidate>> = (0..p.devices.len())
            .map(|d| {
                if best.chain.contains(&d) {
                    return None;
                }
                search.best(&p, &pins, &Constraint { required: Some(d), ..Constraint::all(p.devices.len()) })
            })
            .collect();
        match with.iter().flatten().find(|w| better(w, &best)) {
            Some(w) => best = w.clone(),
            None => break with,
        }
    };
    let best = &balance(&p, avoid_refused_sizes(&p, best, &pins, &mut notes)?, &pins, &mut notes);
    let mut plan = p.to_plan(best);
    let mut why = Vec::new();
    let best_devices: Vec<&str> = best.chain.iter().map(|&d| p.devices[d].id.as_str()).collect();
    if best.chain.len() == 1 {
        why.push(format!("The model fits on {} alone: no split, no network hops.", best_devices[0]));
    } else {
        let ranges: Vec<String> =
            plan.stages.iter().map(|s| format!("layers {}-{} on {}", s.first, s.last, s.device)).collect();
        why.push(format!("Split into {} stages over {} host(s): {}.", best.chain.len(), best.hosts, ranges.join(", ")));
        for (i, &d) in best.chain.iter().enumerate() {
            if pins.iter().any(|p| p.0 == d) {
                why.push(format!(
                    "{} holds layers {}-{} as pinned.",
                    p.devices[d].id,
                    best.bounds[i],
                    best.bounds[i + 1]
                ));
                continue;
            }
            let units = (best.bounds[i + 1] - best.bounds[i]).div_ceil(p.model.period);
            let full = units >= p.capacity(d, i == 0, i + 1 == best.chain.len());
            if full && !is_slowest(&p, &best.chain, d) && pins.is_empty() {
                why.push(format!(
                    "{} is full with {} layer(s); the rest go to the fastest devices with room.",
                    p.devices[d].id,
                    best.bounds[i + 1] - best.bounds[i]
                ));
            }
            // Asked only when it can be said (no pins): a search per device.
            let needed = pins.is_empty() && {
                let mut without = Constraint::all(p.devices.len());
                without.allowed[d] = false;
                !search.fits(&p, &without)
            };
            if needed {
                let n = best.bounds[i + 1] - best.bounds[i];
                why.push(format!(
                    "{} is needed for memory: without it the model does not fit; it holds {n} layer(s){}.",
                    p.devices[d].id,
                    if is_slowest(&p, &best.chain, d) { ", as few as fit, being the slowest" } else { "" }
                ));
            }
        }
    }
    for (d, with_d) in with.iter().enumerate() {
        if best.chain.contains(&d) {
            continue;
        }
        let id = &p.devices[d].id;
        match with_d {
            Some(w) => {
                let cap = p.capacity(d, false, false);
                why.push(format!(
                    "{id} not used: the best placement with it predicts {} tok/s instead of {} (+{:.2} ms/token); {} layer(s) would fit there but cost more than they save.",
                    rate(1000.0 / w.decode_ms),
                    rate(plan.predicted_tok_s),
                    w.decode_ms - best.decode_ms,
                    (cap * p.model.period).min(p.model.layers)
                ));
            }
            None => why.push(format!("{id} not used: no placement that includes it fits.")),
        }
    }
    for &d in &best.chain {
        if p.devices[d].estimated {
            why.push(format!("{}'s speed is estimated from its memory bandwidth, not measured.", p.devices[d].id));
        }
    }
    for w in best.chain.windows(2).chain(std::iter::once([best.chain[best.chain.len() - 1], best.chain[0]].as_slice()))
    {
        let (a, b) = (&p.devices[w[0]].host, &p.devices[w[1]].host);
        if best.chain.len() > 1 && p.cluster.link(a, b).assumed {
            why.push(format!(
                "No measured link between {a} and {b}: assumed {} ms per frame.",
                crate::profile::ASSUMED_LINK_MS
            ));
        }
    }
    why.dedup();
    // Replicas: hosts that can each hold the whole model by themselves.
    if pins.is_empty() {
        let mut hosts: Vec<&str> = p.devices.iter().map(|d| d.host.as_str()).collect();
        hosts.sort_unstable();
        hosts.dedup();
        let mut replicas: Vec<Replica> = hosts
            .iter()
            .filter_map(|h| {
                let own = Constraint { allowed: p.devices.iter().map(|d| d.host == *h).collect(), required: None };
                search.best(&p, &pins, &own).map(|c| Replica {
                    host: h.to_string(),
                    stages: p.stages(&c.chain, &c.bounds),
                    predicted_tok_s: 1000.0 / c.decode_ms,
                })
            })
            .collect();
        if replicas.len() >= 2 {
            replicas.sort_by(|a, b| b.predicted_tok_s.total_cmp(&a.predicted_tok_s));
            let names: Vec<&str> = replicas.iter().map(|r| r.host.as_str()).collect();
            let sum: f64 = replicas.iter().map(|r| r.predicted_tok_s).sum();
            why.push(format!(
                "{} can each hold the whole model: for concurrent users run one replica on each ({} tok/s together) rather than a pipeline.",
                names.join(", "),
                rate(sum)
            ));
            plan.replicas = replicas;
        }
    }
    notes.extend(why);
    plan.explanation = notes;
    Ok(plan)
}

/// A rate with three significant digits.
fn rate(x: f64) -> String {
    let decimals = if x >= 100.0 {
        0
    } else if x >= 10.0 {
        1
    } else {
        2
    };
    format!("{x:.decimals$}")
}

/// Whether `d` is strictly the slowest device of `chain`.
fn is_slowest(p: &Problem<'_>, chain: &[usize], d: usize) -> bool {
    chain.iter().all(|&o| o == d || p.devices[o].ms_per_layer < p.devices[d].ms_per_layer)
}

/// The error when nothing fits: how much memory is missing, from filling every device
/// (in a chain of all of them) as full as it goes.
fn no_fit(p: &Problem<'_>, pins: &[(usize, u32, u32)], search: &Search) -> PlanError {
    if !pins.is_empty() {
        // Would it fit without the pins?
        if search.best(p, &[], &Constraint::all(p.devices.len())).is_some() {
            let list: Vec<String> = p.opts.pins.iter().map(|x| format!("{} on {}", x.layers, x.device)).collect();
            return PlanError::Pin(format!(
                "no placement honours the pins ({}): a pinned device lacks the memory, or the rest does not fit around them",
                list.join(", ")
            ));
        }
    }
    // Sizes come from profiles: every sum and product saturates (an absurd profile
    // reports u64::MAX missing rather than overflowing).
    let k = p.devices.len();
    let held = (0..k).fold(0u32, |a, d| a.saturating_add(p.capacity(d, d == 0, d + 1 == k)));
    let missing_units = p.units.saturating_sub(held).max(1);
    let period = u64::from(p.model.period);
    let unit_bytes = p.model.layer_bytes.iter().max().copied().unwrap_or(0).saturating_mul(period).saturating_add(
        u64::from(p.opts.sizing.context)
            .saturating_mul(u64::from(p.opts.sizing.sessions))
            .saturating_mul(p.model.kv_bytes_per_token_per_layer)
            .saturating_mul(period),
    );
    let usable = (0..k).fold(0u64, |a, d| a.saturating_add(p.usable(d)));
    if k == 1 {
        // One device holds the whole model or nothing, so "the layers that found no
        // room" would be all of them: say what the whole model lacks instead.
        let need = p.model.stage_memory(p.unit_range(0, p.units), &p.opts.sizing).total();
        return PlanError::DoesNotFit {
            missing_bytes: need.saturating_sub(usable).max(1),
            detail: format!(
                "1 device with {} usable after a reserve of {}; the whole model needs {}",
                fmt_size(usable),
                fmt_size(p.opts.reserve_bytes),
                fmt_size(need)
            ),
        };
    }
    PlanError::DoesNotFit {
        missing_bytes: u64::from(missing_units).saturating_mul(unit_bytes),
        detail: format!(
            "{} device(s) with {} usable after a reserve of {} each hold about {} of {} layers",
            k,
            fmt_size(usable),
            fmt_size(p.opts.reserve_bytes),
            p.unit_range(0, held).end,
            p.model.layers
        ),
    }
}

/// Parse "0-32:desktop/gpu0,32-64:laptop/igpu" (or pins in the same form).
pub fn parse_stages(s: &str) -> Result<Vec<Pin>, PlanError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|part| {
            let bad = || PlanError::Placement(format!("{part:?}: expected FIRST-LAST:DEVICE, e.g. 0-16:desktop/gpu0"));
            let (range, device) = part.trim().split_once(':').ok_or_else(bad)?;
            let (a, b) = range.split_once('-').ok_or_else(bad)?;
            let start = a.trim().parse().map_err(|_| bad())?;
            let end = b.trim().parse().map_err(|_| bad())?;
            if device.trim().is_empty() {
                return Err(bad());
            }
            Ok(Pin { device: device.trim().to_string(), layers: LayerRange { start, end } })
        })
        .collect()
}

/// Predict a given placement (stages in order). A placement that does not fit is
/// still predicted, with `fits: false` and the overflow explained.
pub fn predict(model: &ModelProfile, cluster: &Cluster, stages: &[Pin], opts: &Options) -> Result<Plan, PlanError> {
    let opts = Options { exclude: Vec::new(), ..opts.clone() };
    let (p, _) = problem(model, cluster, &opts)?;
    let mut chain = Vec::new();
    let mut bounds = vec![0u32];
    for s in stages {
        let Some(d) = p.devices.iter().position(|d| d.id == s.device) else {
            return Err(PlanError::Placement(format!("device {:?} is not in the cluster", s.device)));
        };
        if chain.contains(&d) {
            return Err(PlanError::Placement(format!("device {} appears twice", s.device)));
        }
        if s.layers.start != *bounds.last().unwrap_or(&0) || s.layers.end <= s.layers.start {
            return Err(PlanError::Placement(format!(
                "stages must cover the layers in order without gaps: {} on {} does not follow {}",
                s.layers,
                s.device,
                bounds.last().unwrap_or(&0)
            )));
        }
        if s.layers.end % p.model.period != 0 && s.layers.end != p.model.layers {
            return Err(PlanError::Placement(format!(
                "boundary {} is not a multiple of the architecture's period {}",
                s.layers.end, p.model.period
            )));
        }
        if p.model.refused_stage_layers.contains(&s.layers.len()) {
            return Err(PlanError::Placement(format!(
                "{} on {}: llama.cpp would take a stage of {} layers of this model for another variant of it",
                s.layers,
                s.device,
                s.layers.len()
            )));
        }
        chain.push(d);
        bounds.push(s.layers.end);
    }
    if chain.is_empty() || *bounds.last().unwrap_or(&0) != p.model.layers {
        return Err(PlanError::Placement(format!("the stages must end at the last layer ({})", p.model.layers)));
    }
    let c = p.candidate(chain, bounds);
    let mut plan = p.to_plan(&c);
    for (s, &d) in plan.stages.iter().zip(&c.chain) {
        if s.memory_bytes > p.usable(d) {
            plan.explanation.push(format!(
                "{} needs {} but has {} usable (after a reserve of {}): this placement does not fit.",
                s.device,
                fmt_size(s.memory_bytes),
                fmt_size(p.usable(d)),
                fmt_size(p.opts.reserve_bytes)
            ));
        }
    }
    if plan.fits {
        plan.explanation.push("A given placement, predicted as it is.".into());
    }
    Ok(plan)
}

/// Every placement the exhaustive search considers (every ordered chain that fits,
/// filled greedily), with its predicted decode ms per token; for tests that check
/// the chosen plan against all of them. Factorial in the devices: small clusters only.
#[doc(hidden)]
pub fn considered(model: &ModelProfile, cluster: &Cluster, opts: &Options) -> Result<Vec<(Vec<Pin>, f64)>, PlanError> {
    let (p, _) = problem(model, cluster, opts)?;
    let pins = resolve_pins(&p)?;
    Ok(p.candidates(&pins)
        .iter()
        .map(|c| {
            let stages = c
                .chain
                .iter()
                .enumerate()
                .map(|(i, &d)| Pin {
                    device: p.devices[d].id.clone(),
                    layers: LayerRange { start: c.bounds[i], end: c.bounds[i + 1] },
                })
                .collect();
            (stages, c.decode_ms)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Link;

    /// A host's CPU (32 MB) and a fast GPU (90 MB), a 30-layer model of 3 MB layers
    /// with an 8 MB embedding and a 20 MB head: the GPU holds 27 layers when it takes
    /// the embedding (stage 0 first on it), 23 when it takes the head. As llama.cpp runs a
    /// node's CPU and GPU in one context (the embedding in RAM, the GPU's layers the
    /// last), an offloading GPU never goes first.
    #[test]
    fn an_offloading_gpu_never_starts_its_hosts_run() {
        const MB: u64 = 1 << 20;
        let model = small_model(30, 8 * MB, 20 * MB);
        let opts =
            Options { sizing: Sizing { context: 16, sessions: 1, chunk: 16 }, reserve_bytes: 0, ..Options::default() };
        let cluster = |offload: bool| Cluster {
            devices: vec![
                device("a/cpu", "a", 32 * MB, 1.0),
                Device { offload, ..device("a/gpu", "a", 90 * MB, 0.05) },
            ],
            links: vec![],
        };
        let order = |p: &Plan| p.stages.iter().map(|s| s.device.clone()).collect::<Vec<_>>();
        for plan in [plan, plan_exhaustive] {
            let free = plan(&model, &cluster(false), &opts).unwrap();
            assert_eq!(order(&free), ["a/gpu", "a/cpu"], "without the rule the GPU takes stage 0");
            let offload = plan(&model, &cluster(true), &opts).unwrap();
            assert_eq!(order(&offload), ["a/cpu", "a/gpu"]);
            assert!(offload.predicted_tok_s <= free.predicted_tok_s);
        }
    }

    /// DeepSeek V3 (61 layers): a fast device with room for exactly 27 layers would
    /// take 27, a stage llama.cpp would misread; the plan moves the boundary so that it
    /// holds 25 (26 is refused too, 28 does not fit) and says so.
    #[test]
    fn no_stage_has_a_size_llama_cpp_misreads() {
        const MB: u64 = 1 << 20;
        let model = ModelProfile { refused_stage_layers: vec![26, 27], ..small_model(61, 0, 0) };
        let opts =
            Options { sizing: Sizing { context: 16, sessions: 1, chunk: 16 }, reserve_bytes: 0, ..Options::default() };
        let cluster = Cluster {
            devices: vec![device("a/fast", "a", 27 * 3 * MB + MB / 2, 0.05), device("a/slow", "a", 400 * MB, 1.0)],
            links: vec![],
        };
        for plan in [plan, plan_exhaustive] {
            let held = |p: &Plan, d: &str| p.stages.iter().find(|s| s.device == d).map(|s| s.last - s.first);
            // Without the rule, the fast device holds 27.
            let free = ModelProfile { refused_stage_layers: Vec::new(), ..model.clone() };
            assert_eq!(held(&plan(&free, &cluster, &opts).unwrap(), "a/fast"), Some(27));
            let p = plan(&model, &cluster, &opts).unwrap();
            assert_eq!((held(&p, "a/fast"), held(&p, "a/slow")), (Some(25), Some(36)), "{p:#?}");
            assert!(p.explanation.iter().any(|e| e.contains("moved to") && e.contains("[26, 27]")), "{p:#?}");
        }
    }

    /// Three like machines whose measured speeds differ by 1%, none able to hold more
    /// than 12 of 30 layers (beside their buffers): for one session the fastest chain
    /// fills two and leaves the rest to the slowest (12/12/6); for several sessions the layers are
    /// evened out (10/10/10: a pipeline of sessions runs at its slowest stage's pace)
    /// for a single-stream cost within the tolerance, and the plan says so. A fast GPU
    /// beside a CPU keeps its layers: moving one would cost far more than the tolerance.
    #[test]
    fn several_sessions_even_out_the_stages() {
        const MB: u64 = 1 << 20;
        let model = small_model(30, 0, 0);
        let opts = |sessions| Options {
            sizing: Sizing { context: 16, sessions, chunk: 16 },
            reserve_bytes: 0,
            ..Options::default()
        };
        let like = Cluster {
            devices: vec![
                device("a/cpu", "a", 13 * 3 * MB, 1.00),
                device("b/cpu", "a", 13 * 3 * MB, 0.99),
                device("c/cpu", "a", 13 * 3 * MB, 1.01),
            ],
            links: vec![],
        };
        let sizes = |p: &Plan| {
            let mut n: Vec<u32> = p.stages.iter().map(|s| s.last - s.first).collect();
            n.sort_unstable();
            n
        };
        for plan in [plan, plan_exhaustive] {
            let one = plan(&model, &like, &opts(1)).unwrap();
            assert_eq!(sizes(&one), [6, 12, 12], "{one:#?}");
            assert!(!one.explanation.iter().any(|e| e.contains("evened out")), "{one:#?}");
            let four = plan(&model, &like, &opts(4)).unwrap();
            assert_eq!(sizes(&four), [10, 10, 10], "{four:#?}");
            assert!(four.predicted_tok_s >= one.predicted_tok_s / (1.0 + BALANCE_TOLERANCE), "{four:#?}");
            let slowest = |p: &Plan| p.stages.iter().map(|s| s.ms_per_token).fold(0.0, f64::max);
            assert!(slowest(&four) < slowest(&one) * 0.9, "{four:#?}");
            assert!(four.explanation.iter().any(|e| e.contains("evened out for 4 sessions")), "{four:#?}");
            assert!(four.fits);

            let gpu = Cluster {
                devices: vec![device("a/cpu", "a", 100 * MB, 1.0), device("a/gpu", "a", 27 * 3 * MB, 0.05)],
                links: vec![],
            };
            let (one, four) = (plan(&model, &gpu, &opts(1)).unwrap(), plan(&model, &gpu, &opts(4)).unwrap());
            assert_eq!(sizes(&one), [4, 26]);
            let layout = |p: &Plan| p.stages.iter().map(|s| (s.device.clone(), s.first, s.last)).collect::<Vec<_>>();
            assert_eq!(layout(&four), layout(&one), "the GPU's layers stay");
        }
    }

    /// A model of `layers` layers of 3 MiB, with these embedding and head sizes.
    fn small_model(layers: u32, embed_bytes: u64, head_bytes: u64) -> ModelProfile {
        const MB: u64 = 1 << 20;
        ModelProfile {
            layers,
            layer_bytes: vec![3 * MB; layers as usize],
            embed_bytes,
            head_bytes,
            tied_embeddings: false,
            other_bytes: 0,
            n_embd: 8,
            n_vocab: 16,
            n_ff: 8,
            period: 1,
            sliding_window: false,
            refused_stage_layers: Vec::new(),
            kv_bytes_per_token_per_layer: 0,
        }
    }

    fn device(id: &str, host: &str, memory_bytes: u64, ms: f64) -> Device {
        Device {
            id: id.into(),
            host: host.into(),
            memory_bytes,
            ms_per_layer: ms,
            prefill_ms_per_layer_token: Some(ms),
            head_ms: ms,
            wake_ms: ms,
            keepalive: false,
            estimated: false,
            offload: false,
        }
    }

    /// One device too small for the whole model: the error says what the whole model
    /// lacks (a few MiB here), not every layer's bytes (it holds the model or nothing).
    #[test]
    fn one_device_short_of_the_model_is_told_what_it_lacks() {
        const MB: u64 = 1 << 20;
        let m = small_model(30, 4 * MB, 4 * MB);
        let need = m.stage_memory(LayerRange::new(0, 30), &Options::default().sizing).total();
        let reserve = Options::default().reserve_bytes;
        let cluster = Cluster { devices: vec![device("a/0", "a", need + reserve - 5 * MB, 1.0)], links: vec![] };
        for search in [plan, plan_exhaustive] {
            match search(&m, &cluster, &Options::default()) {
                Err(e @ PlanError::DoesNotFit { missing_bytes, .. }) => {
                    assert_eq!(missing_bytes, 5 * MB, "{e}");
                    assert!(e.to_string().contains("the whole model needs"), "{e}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// Sizes at the edge of their types (what a profile or GGUF can claim) go through
    /// every function without overflowing: capacities, the error's missing bytes,
    /// unit ranges past u32, both searches, predictions.
    #[test]
    fn absurd_profiles_do_not_overflow() {
        let huge = ModelProfile {
            layers: 4096,
            layer_bytes: vec![u64::MAX; 4096],
            embed_bytes: u64::MAX,
            head_bytes: u64::MAX,
            tied_embeddings: false,
            other_bytes: u64::MAX,
            n_embd: u32::MAX,
            n_vocab: u32::MAX,
            n_ff: u32::MAX,
            period: 1,
            sliding_window: false,
            refused_stage_layers: Vec::new(),
            kv_bytes_per_token_per_layer: u64::MAX,
        };
        let cluster = Cluster {
            devices: vec![
                device("a/0", "a", u64::MAX, f64::MAX),
                device("a/1", "a", u64::MAX, 0.0),
                device("b/0", "b", u64::MAX, f64::MAX),
            ],
            links: vec![Link {
                hosts: ["a".into(), "b".into()],
                ms_per_frame: f64::MAX,
                mbit_per_s: Some(f64::MIN_POSITIVE),
            }],
        };
        let opts = Options {
            sizing: Sizing { context: u32::MAX, sessions: u32::MAX, chunk: u32::MAX },
            // With no reserve a u64::MAX device would "hold" a saturated u64::MAX.
            reserve_bytes: 1,
            prompt_tokens: u32::MAX,
            ..Options::default()
        };
        for search in [plan, plan_exhaustive] {
            match search(&huge, &cluster, &opts) {
                Err(PlanError::DoesNotFit { missing_bytes, .. }) => assert_eq!(missing_bytes, u64::MAX),
                other => panic!("an absurd model fits nowhere: {other:?}"),
            }
        }
        // A period past the layers (one unit), and one whose multiples pass u32::MAX.
        for period in [u32::MAX, u32::MAX / 3 + 1] {
            let small = ModelProfile {
                layers: 4096,
                layer_bytes: vec![1; 4096],
                period,
                sliding_window: false,
                refused_stage_layers: Vec::new(),
                kv_bytes_per_token_per_layer: 1,
                n_embd: 1,
                n_vocab: 1,
                n_ff: 1,
                embed_bytes: 1,
                head_bytes: 1,
                other_bytes: 0,
                ..huge.clone()
            };
            let opts = Options { sizing: Sizing { context: 1, sessions: 1, chunk: 1 }, ..opts.clone() };
            for search in [plan, plan_exhaustive] {
                let p = search(&small, &cluster, &opts).expect("one unit fits anywhere");
                assert_eq!((p.stages.len(), p.stages[0].last), (1, 4096));
            }
        }
        // Fits, with infinite times: predicted, not panicking.
        let fits = ModelProfile { layer_bytes: vec![1; 4096], kv_bytes_per_token_per_layer: 1, ..huge.clone() };
        let stages = parse_stages("0-2048:a/0,2048-4096:b/0").unwrap();
        let p = predict(
            &fits,
            &cluster,
            &stages,
            &Options { sizing: Sizing { context: 1, sessions: 1, chunk: 1 }, ..opts },
        )
        .unwrap();
        assert_eq!(p.stages.len(), 2);
        // Pins at the end of the range.
        let pinned = Options { pins: parse_stages("4095-4096:b/0").unwrap(), ..Options::default() };
        assert!(matches!(plan(&huge, &cluster, &pinned), Err(PlanError::DoesNotFit { .. } | PlanError::Pin(_))));
    }
}
