//! Choosing and predicting placements.
//!
//! Decode time per token is modelled as (DESIGN, "Placement model"):
//! Σ over stages (its layers × the device's ms per layer) + the tail device's LM-head
//! time + Σ over the hops a token crosses, including the tail → coordinator return
//! (the link's time per frame + the receiving device's wake-up cost). For a fixed
//! ordered chain of devices, the best layer counts follow greedily (every device at
//! least one period, then the fastest devices filled up to their memory), so the
//! planner enumerates chains, keeps one host's devices adjacent, and fills each.

use crate::model::{ModelProfile, Sizing};
use crate::profile::{Cluster, Device};
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
    #[error("the model does not fit: about {} more is needed ({detail})", gib(*missing_bytes))]
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

/// Bytes as GiB for people.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30))
}

/// Devices enumerated at most (chains grow factorially).
const MAX_DEVICES: usize = 9;

/// Ordered devices and their layer boundaries: `bounds[i]..bounds[i+1]` on `chain[i]`.
#[derive(Clone, Debug)]
struct Candidate {
    chain: Vec<usize>,
    bounds: Vec<u32>,
    decode_ms: f64,
    hosts: usize,
}

/// The planner's view of one problem.
struct Problem<'a> {
    model: &'a ModelProfile,
    devices: Vec<&'a Device>,
    cluster: &'a Cluster,
    opts: &'a Options,
    /// Units of `period` layers (the last may be shorter).
    units: u32,
}

impl Problem<'_> {
    fn unit_range(&self, first_unit: u32, n: u32) -> LayerRange {
        let p = self.model.period;
        LayerRange { start: first_unit * p, end: ((first_unit + n) * p).min(self.model.layers) }
    }

    fn usable(&self, d: usize) -> u64 {
        self.devices[d].memory_bytes.saturating_sub(self.opts.reserve_bytes)
    }

    /// Most units device `d` can hold as stage 0 (`first`), the tail, or a middle
    /// stage. Stage 0's and the tail's layers are known (the first or last units), so
    /// their memory is exact; a middle stage's position depends on the stages before
    /// it, so the biggest units bound it: a chain filled by counts never overflows.
    fn capacity(&self, d: usize, first: bool, tail: bool) -> u32 {
        let m = self.model;
        let usable = self.usable(d);
        let unit_bytes: Vec<u64> = m.layer_bytes.chunks(m.period as usize).map(|c| c.iter().sum()).collect();
        let mut biggest = unit_bytes.clone();
        biggest.sort_unstable_by(|a, b| b.cmp(a));
        let mut best = 0;
        for n in 1..=self.units {
            let (bytes, layers) = if first || tail {
                let r = if first { self.unit_range(0, n) } else { self.unit_range(self.units - n, n) };
                let r = if first && tail { self.unit_range(0, self.units) } else { r };
                (m.layer_bytes[r.start as usize..r.end as usize].iter().sum(), r.end - r.start)
            } else {
                (biggest[..n as usize].iter().sum(), (n * m.period).min(m.layers))
            };
            if m.memory_of(bytes, layers, first, tail, &self.opts.sizing).total() > usable {
                break;
            }
            best = n;
        }
        best
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

    /// Fill `chain` with layers: pinned devices get their pins, every other device at
    /// least one unit, then the fastest devices as much as fits. `None` if impossible.
    fn fill(&self, chain: &[usize], pins: &[(usize, u32, u32)]) -> Option<Vec<u32>> {
        let k = chain.len();
        let mut units = vec![0u32; k];
        let mut fixed = vec![false; k];
        // Segments of free positions between pinned ones, each with a unit total.
        let mut segments: Vec<(Vec<usize>, u32)> = Vec::new();
        let mut seg = Vec::new();
        let mut seg_start = 0u32;
        for (i, &d) in chain.iter().enumerate() {
            if let Some(&(_, a, b)) = pins.iter().find(|p| p.0 == d) {
                if a < seg_start {
                    return None;
                }
                segments.push((std::mem::take(&mut seg), a - seg_start));
                units[i] = b - a;
                fixed[i] = true;
                seg_start = b;
            } else {
                seg.push(i);
            }
        }
        segments.push((seg, self.units - seg_start.min(self.units)));
        if pins.iter().any(|p| !chain.contains(&p.0)) {
            return None;
        }
        for (positions, total) in &segments {
            if positions.is_empty() {
                if *total != 0 {
                    return None;
                }
                continue;
            }
            // Capacities depend on the position (stage 0 keeps the embedding, the tail
            // the LM head).
            let caps: Vec<u32> = positions.iter().map(|&i| self.capacity(chain[i], i == 0, i + 1 == k)).collect();
            if caps.contains(&0) || (positions.len() as u32) > *total {
                return None;
            }
            let mut left = total - positions.len() as u32;
            for &i in positions {
                units[i] = 1;
            }
            let mut by_speed: Vec<usize> = (0..positions.len()).collect();
            by_speed.sort_by(|&a, &b| {
                let (da, db) = (self.devices[chain[positions[a]]], self.devices[chain[positions[b]]]);
                da.ms_per_layer.total_cmp(&db.ms_per_layer).then(a.cmp(&b))
            });
            for j in by_speed {
                let add = left.min(caps[j] - 1);
                units[positions[j]] += add;
                left -= add;
            }
            if left > 0 {
                return None;
            }
        }
        // Pinned stages must fit too.
        for (i, &d) in chain.iter().enumerate() {
            if fixed[i] && units[i] > self.capacity(d, i == 0, i + 1 == k) {
                return None;
            }
        }
        let mut bounds = vec![0u32];
        let mut at = 0;
        for u in units {
            at += u;
            bounds.push(self.unit_range(0, at).end);
        }
        Some(bounds)
    }

    /// Every ordered chain with one host's devices adjacent, in a fixed order.
    fn chains(&self) -> Vec<Vec<usize>> {
        fn grow(p: &Problem<'_>, chain: &mut Vec<usize>, used: &mut Vec<bool>, out: &mut Vec<Vec<usize>>) {
            if !chain.is_empty() {
                out.push(chain.clone());
            }
            if chain.len() as u32 == p.units {
                return;
            }
            for d in 0..p.devices.len() {
                if used[d] {
                    continue;
                }
                let host = &p.devices[d].host;
                let last_host = chain.last().map(|&l| &p.devices[l].host);
                // A host already in the chain must be the last one (its devices adjacent).
                if last_host != Some(host) && chain.iter().any(|&c| &p.devices[c].host == host) {
                    continue;
                }
                used[d] = true;
                chain.push(d);
                grow(p, chain, used, out);
                chain.pop();
                used[d] = false;
            }
        }
        let mut out = Vec::new();
        grow(self, &mut Vec::new(), &mut vec![false; self.devices.len()], &mut out);
        out
    }

    fn candidates(&self, pins: &[(usize, u32, u32)]) -> Vec<Candidate> {
        let mut out = Vec::new();
        for chain in self.chains() {
            if let Some(bounds) = self.fill(&chain, pins) {
                let (decode_ms, _) = self.decode_ms(&chain, &bounds);
                let mut hosts: Vec<&str> = chain.iter().map(|&d| self.devices[d].host.as_str()).collect();
                hosts.dedup();
                out.push(Candidate { chain, bounds, decode_ms, hosts: hosts.len() });
            }
        }
        out
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

fn best_of<'c>(cands: impl IntoIterator<Item = &'c Candidate>) -> Option<&'c Candidate> {
    cands.into_iter().fold(None, |best, c| match best {
        Some(b) if !better(c, b) => Some(b),
        _ => Some(c),
    })
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
    let mut devices: Vec<&Device> =
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
    if devices.len() > MAX_DEVICES {
        // Keep the devices with the most memory, then the fastest.
        devices.sort_by(|a, b| b.memory_bytes.cmp(&a.memory_bytes).then(a.ms_per_layer.total_cmp(&b.ms_per_layer)));
        for d in &devices[MAX_DEVICES..] {
            notes.push(format!("{} not considered: only the {MAX_DEVICES} devices with the most memory are.", d.id));
        }
        devices.truncate(MAX_DEVICES);
    }
    let units = model.layers.div_ceil(model.period);
    Ok((Problem { model, devices, cluster, opts, units }, notes))
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
    let (p, mut notes) = problem(model, cluster, opts)?;
    let pins = resolve_pins(&p)?;
    let cands = p.candidates(&pins);
    let Some(best) = best_of(&cands) else {
        return Err(no_fit(&p, &pins));
    };
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
            let without = best_of(cands.iter().filter(|c| !c.chain.contains(&d)));
            let units = (best.bounds[i + 1] - best.bounds[i]).div_ceil(p.model.period);
            let full = units >= p.capacity(d, i == 0, i + 1 == best.chain.len());
            if full && !is_slowest(&p, &best.chain, d) && pins.is_empty() {
                why.push(format!(
                    "{} is full with {} layer(s); the rest go to the fastest devices with room.",
                    p.devices[d].id,
                    best.bounds[i + 1] - best.bounds[i]
                ));
            }
            if without.is_none() && pins.is_empty() {
                let n = best.bounds[i + 1] - best.bounds[i];
                why.push(format!(
                    "{} is needed for memory: without it the model does not fit; it holds {n} layer(s){}.",
                    p.devices[d].id,
                    if is_slowest(&p, &best.chain, d) { ", as few as fit, being the slowest" } else { "" }
                ));
            }
        }
    }
    for d in 0..p.devices.len() {
        if best.chain.contains(&d) {
            continue;
        }
        let id = &p.devices[d].id;
        match best_of(cands.iter().filter(|c| c.chain.contains(&d))) {
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
                let own = cands.iter().filter(|c| c.chain.iter().all(|&d| p.devices[d].host == *h));
                best_of(own).map(|c| Replica {
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
fn no_fit(p: &Problem<'_>, pins: &[(usize, u32, u32)]) -> PlanError {
    if !pins.is_empty() {
        // Would it fit without the pins?
        if !p.candidates(&[]).is_empty() {
            let list: Vec<String> = p.opts.pins.iter().map(|x| format!("{} on {}", x.layers, x.device)).collect();
            return PlanError::Pin(format!(
                "no placement honours the pins ({}): a pinned device lacks the memory, or the rest does not fit around them",
                list.join(", ")
            ));
        }
    }
    let k = p.devices.len();
    let mut held = 0u32;
    for d in 0..k {
        held += p.capacity(d, d == 0, d + 1 == k);
    }
    let missing_units = p.units.saturating_sub(held).max(1);
    let unit_bytes = p.model.layer_bytes.iter().max().copied().unwrap_or(0) * u64::from(p.model.period)
        + u64::from(p.opts.sizing.context)
            * u64::from(p.opts.sizing.sessions)
            * p.model.kv_bytes_per_token_per_layer
            * u64::from(p.model.period);
    let usable: u64 = (0..k).map(|d| p.usable(d)).sum();
    PlanError::DoesNotFit {
        missing_bytes: u64::from(missing_units) * unit_bytes,
        detail: format!(
            "{} device(s) with {} usable after a reserve of {} each hold about {} of {} layers",
            k,
            gib(usable),
            gib(p.opts.reserve_bytes),
            (held * p.model.period).min(p.model.layers),
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
        chain.push(d);
        bounds.push(s.layers.end);
    }
    if chain.is_empty() || *bounds.last().unwrap_or(&0) != p.model.layers {
        return Err(PlanError::Placement(format!("the stages must end at the last layer ({})", p.model.layers)));
    }
    let (decode_ms, _) = p.decode_ms(&chain, &bounds);
    let mut hosts: Vec<&str> = chain.iter().map(|&d| p.devices[d].host.as_str()).collect();
    hosts.dedup();
    let c = Candidate { chain, bounds, decode_ms, hosts: hosts.len() };
    let mut plan = p.to_plan(&c);
    for (s, &d) in plan.stages.iter().zip(&c.chain) {
        if s.memory_bytes > p.usable(d) {
            plan.explanation.push(format!(
                "{} needs {} but has {} usable (after a reserve of {}): this placement does not fit.",
                s.device,
                gib(s.memory_bytes),
                gib(p.usable(d)),
                gib(p.opts.reserve_bytes)
            ));
        }
    }
    if plan.fits {
        plan.explanation.push("A given placement, predicted as it is.".into());
    }
    Ok(plan)
}

/// Every placement the planner considers, with its predicted decode ms per token;
/// for tests that check the chosen plan against all of them.
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
