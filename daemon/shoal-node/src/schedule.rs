//! The leader's scheduler: cluster state in, placement changes out. Pure (no I/O, no
//! clock), so it is tested like the election core; the node runs it on the leader
//! whenever membership or the loads change, and commits what it returns.
//!
//! Rules:
//! - A model the owner asked to load (`load/<hash>`) gets a placement on live members
//!   that hold enough memory (each member's offer), planned by `shoal-planner`.
//! - A working placement is kept: a re-plan never interrupts a generation for speed. It
//!   is replaced only when one of its nodes is down (or excluded, or gone), or the load
//!   asks for another context.
//! - A placement that lost nodes is repaired before it is re-planned: each lost stage
//!   moves, layers unchanged, to a free member whose offer holds it, and the other
//!   stages stay where they run. Only the moved stages fetch a shard; the others find
//!   theirs in their cache, so the model serves again sooner and moves fewer bytes than
//!   after a plan from scratch (which may give every node a new layer range). A full
//!   re-plan happens when no spare can take a lost stage.
//! - A placement that lost only members that may come back ([`Inputs::returning`]:
//!   down for less than [`DOWN_GRACE`]) and that no spare can repair is kept as it is:
//!   a closed lid, a WiFi drop or a restart costs the other stages nothing, and when
//!   the member is back the ring goes on where it stopped, its caches intact. Tearing
//!   it down (a plan from scratch that cannot place the model) would stop every stage,
//!   and the member's return would reload them all and recompute every generation.
//!   After the grace the plan from scratch is committed (and says why).
//! - A working placement is re-planned for speed only when a fresh plan predicts at
//!   least [`REPLAN_GAIN`] times its decode speed (a bigger or faster machine joined)
//!   *and* the model is idle: no generation running or queued at its coordinator (the
//!   leader asks; [`Inputs::idle`]). A re-plan costs a reload and maybe transfers, so
//!   a small gain is not worth it, and a generation is never cut for speed.
//! - One model per node: a node running a stage of one model is not planned for another.
//! - A model that does not fit gets a placement without stages and an error saying why;
//!   it is planned again as members come back.
//! - A placement whose load was removed (`unload`) is deleted.
//! - Plans rest on measured speeds: every free member is asked to time a few layers of
//!   a loaded model ([`to_measure`]; a [`Speed`] entry per member and model), and a
//!   model is not planned from scratch while such a measurement runs
//!   ([`Inputs::measuring`]). A member that could not be measured is planned with a
//!   speed estimated from memory bandwidth, and the explanation says so.

use shoal_membership::node::LinksEntry;
use shoal_planner::{Cluster, Device, Link, ModelProfile, Options, Sizing};
use shoal_types::{fmt_size, CatalogEntry, GpuOffer, GpuShare, LoadSpec, ModelPlacement, NodeId, PlacedStage, Speed};
use std::collections::{BTreeMap, BTreeSet};

/// Prefill chunk size C of placed models (DESIGN point 10: 128 loses ≤ 5% against 512).
pub const CHUNK: u32 = 128;

/// How much faster (predicted decode tok/s) a fresh plan must be than the working
/// placement before an idle model is moved to it: 25%, well above the planner's
/// estimation noise, so that placements do not flap between near-equal plans.
pub const REPLAN_GAIN: f64 = 1.25;

/// How long a placement waits for a member that went down when nothing else can take
/// its stage: about the ring's own no-progress bound (`RetryPolicy::max_wait`), so a
/// generation caught by it still finishes when the member is back in time.
pub const DOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

/// A member as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberFacts {
    /// Its key.
    pub id: NodeId,
    /// Its name (host names in plans and explanations).
    pub name: String,
    /// Whether it looks alive from the leader.
    pub alive: bool,
    /// RAM it offers to models, bytes.
    pub offer_bytes: u64,
    /// The GPUs it offers (their VRAM), each a device of the plan.
    pub gpus: Vec<GpuOffer>,
}

/// What the scheduler decides from.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// What the owner asked to keep loaded.
    pub loads: Vec<LoadSpec>,
    /// The catalog, by content hash.
    pub catalog: BTreeMap<String, CatalogEntry>,
    /// Planner profiles of the catalog's models, by content hash.
    pub profiles: BTreeMap<String, ModelProfile>,
    /// The placements committed now, by content hash.
    pub placements: BTreeMap<String, ModelPlacement>,
    /// The members.
    pub members: Vec<MemberFacts>,
    /// Models (content hashes) with no generation running or waiting at their
    /// coordinator, as the leader last asked: only these may be re-planned for speed.
    pub idle: BTreeSet<String>,
    /// Members' measured speeds, by (member, model content hash).
    pub speeds: BTreeMap<(NodeId, String), Speed>,
    /// Measurements the leader asked for and awaits: their models are not planned from
    /// scratch meanwhile (a plan made now would rest on estimates).
    pub measuring: BTreeSet<(NodeId, String)>,
    /// What each member measured of its links to the others.
    pub links: BTreeMap<NodeId, LinksEntry>,
    /// Members whose link probe the leader asked for (or queued) and awaits: no model
    /// is planned from scratch meanwhile.
    pub probing: BTreeSet<NodeId>,
    /// Members down for less than [`DOWN_GRACE`] as the leader saw them go: a
    /// placement that lost only such members, and that no spare can repair, waits for
    /// them.
    pub returning: BTreeSet<NodeId>,
    /// The cluster state's change index now. New placements take a generation above
    /// it, so a generation is never used twice for a model, even after an unload
    /// (a node that missed the unload must not keep serving an old stage as the new).
    pub index: u64,
}

/// A change to commit.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Set `placement/<model>`.
    Place(ModelPlacement),
    /// Delete `placement/<model>` (the model was unloaded).
    Remove(String),
}

/// The changes that bring the placements in line with the loads and the members.
pub fn schedule(inputs: &Inputs) -> Vec<Decision> {
    let mut out = Vec::new();
    let loads: BTreeMap<&str, &LoadSpec> = inputs.loads.iter().map(|l| (l.model.as_str(), l)).collect();
    for model in inputs.placements.keys() {
        if !loads.contains_key(model.as_str()) {
            out.push(Decision::Remove(model.clone()));
        }
    }
    let alive: BTreeSet<NodeId> = inputs.members.iter().filter(|m| m.alive).map(|m| m.id).collect();
    // Nodes held by placements that stay: first every kept one, so that a model being
    // re-placed cannot take a node another model keeps.
    let mut busy: BTreeMap<NodeId, &str> = BTreeMap::new();
    let mut keep = BTreeSet::new();
    for (model, load) in &loads {
        if let Some(p) = inputs.placements.get(*model) {
            if still_good(inputs, p, load, &alive) {
                keep.insert(*model);
                for s in &p.stages {
                    busy.insert(s.node, model);
                }
            }
        }
    }
    // Idle kept models that a fresh plan beats clearly, on the nodes not kept by others.
    for (model, load) in &loads {
        let Some(p) = inputs.placements.get(*model).filter(|_| keep.contains(model)) else { continue };
        if !inputs.idle.contains(*model) || measuring(inputs, model) {
            continue;
        }
        let this: &str = model;
        let others: BTreeMap<NodeId, &str> = busy.iter().filter(|&(_, &m)| m != this).map(|(n, m)| (*n, *m)).collect();
        let generation = p.generation.max(inputs.index) + 1;
        let mut fresh = place(inputs, load, &alive, &others, generation);
        // A NaN prediction never counts as better.
        let better = fresh.predicted_tok_s.partial_cmp(&(REPLAN_GAIN * p.predicted_tok_s));
        if fresh.stages.is_empty() || !matches!(better, Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal)) {
            continue;
        }
        fresh.explanation.insert(
            0,
            format!(
                "re-planned while idle: {:.1} tok/s predicted against {:.1} before (at least {REPLAN_GAIN}x)",
                fresh.predicted_tok_s, p.predicted_tok_s
            ),
        );
        busy.retain(|_, m| *m != this);
        for s in &fresh.stages {
            busy.insert(s.node, model);
        }
        out.push(Decision::Place(fresh));
    }
    for (model, load) in &loads {
        if keep.contains(model) {
            continue;
        }
        let previous = inputs.placements.get(*model);
        let generation = previous.map_or(0, |p| p.generation).max(inputs.index) + 1;
        let next = match previous.and_then(|p| repair(inputs, p, load, &alive, &busy, generation)) {
            Some(repaired) => repaired,
            // Waiting for its members to come back (nothing to commit meanwhile).
            None if previous.is_some_and(|p| waits_for_return(inputs, p, load, &alive)) => {
                for s in previous.map_or(&[][..], |p| &p.stages) {
                    busy.insert(s.node, model);
                }
                continue;
            }
            // Planned once the members' speeds are in.
            None if measuring(inputs, model) => continue,
            None => place(inputs, load, &alive, &busy, generation),
        };
        if let Some(p) = previous {
            // An unchanged refusal is not committed again (nothing would change but
            // the generation).
            if p.stages.is_empty() && next.stages.is_empty() && p.error == next.error {
                continue;
            }
        }
        for s in &next.stages {
            busy.insert(s.node, model);
        }
        out.push(Decision::Place(next));
    }
    out
}

/// Whether a measurement of `model`, or a link probe, is awaited.
fn measuring(inputs: &Inputs, model: &str) -> bool {
    !inputs.probing.is_empty() || inputs.measuring.iter().any(|(_, m)| m == model)
}

/// The measurements the leader should ask for: for each model to keep loaded, each
/// live member that offers memory, runs no stage (a measurement would slow a running
/// generation, and be slowed by it) and has no sane [`Speed`] for it yet.
/// Measurements already awaited are left out.
pub fn to_measure(inputs: &Inputs) -> Vec<(NodeId, String)> {
    let busy: BTreeSet<NodeId> = inputs.placements.values().flat_map(|p| p.stages.iter().map(|s| s.node)).collect();
    let mut out = Vec::new();
    for load in &inputs.loads {
        if !inputs.catalog.contains_key(&load.model) || !inputs.profiles.contains_key(&load.model) {
            continue;
        }
        for m in &inputs.members {
            let pair = (m.id, load.model.clone());
            let known = inputs.speeds.get(&pair).is_some_and(Speed::is_sane);
            if m.alive && m.offer_bytes > 0 && !busy.contains(&m.id) && !known && !inputs.measuring.contains(&pair) {
                out.push(pair);
            }
        }
    }
    out
}

/// The kept models that a fresh plan would beat by [`REPLAN_GAIN`] if they were idle:
/// the leader asks only their coordinators whether they are.
pub fn better_if_idle(inputs: &Inputs) -> BTreeSet<String> {
    let mut all = inputs.clone();
    all.idle = inputs.placements.keys().cloned().collect();
    let none = Inputs { idle: BTreeSet::new(), ..inputs.clone() };
    let without: BTreeSet<String> = schedule(&none)
        .into_iter()
        .filter_map(|d| match d {
            Decision::Place(p) => Some(p.model),
            Decision::Remove(_) => None,
        })
        .collect();
    schedule(&all)
        .into_iter()
        .filter_map(|d| match d {
            Decision::Place(p) if !without.contains(&p.model) => Some(p.model),
            _ => None,
        })
        .collect()
}

/// Whether placement `p` still serves `load`: valid for the model, the same sizing,
/// every stage on a live member that is not excluded.
fn still_good(inputs: &Inputs, p: &ModelPlacement, load: &LoadSpec, alive: &BTreeSet<NodeId>) -> bool {
    let Some(entry) = inputs.catalog.get(&load.model) else { return false };
    p.is_valid(entry.n_layer)
        && p.context == load.context
        && p.sessions == load.sessions
        && p.stages.iter().all(|s| alive.contains(&s.node) && !load.exclude.contains(&s.node))
}

/// Whether placement `p`, which no spare can repair, should wait for its members:
/// it serves `load` as it is, and each of its nodes is alive or down for less than
/// [`DOWN_GRACE`] (not excluded, not gone from the cluster).
fn waits_for_return(inputs: &Inputs, p: &ModelPlacement, load: &LoadSpec, alive: &BTreeSet<NodeId>) -> bool {
    let Some(entry) = inputs.catalog.get(&load.model) else { return false };
    !p.stages.is_empty()
        && p.is_valid(entry.n_layer)
        && p.context == load.context
        && p.sessions == load.sessions
        && p.stages.iter().all(|s| {
            !load.exclude.contains(&s.node)
                && (alive.contains(&s.node) || inputs.returning.contains(&s.node))
                && inputs.members.iter().any(|m| m.id == s.node)
        })
}

/// `p` with every stage on a down or excluded node moved, layers unchanged, to a live
/// member that is free (not in this placement, not running another model, not
/// excluded) and offers the stage's memory; preferring a member that holds the model
/// (it cuts its shard locally), then the largest offer. `None` when a lost stage finds
/// no such member, or `p` does not serve `load` as it is (another context or session
/// count, no stages): then the model is planned from scratch.
fn repair(
    inputs: &Inputs,
    p: &ModelPlacement,
    load: &LoadSpec,
    alive: &BTreeSet<NodeId>,
    busy: &BTreeMap<NodeId, &str>,
    generation: u64,
) -> Option<ModelPlacement> {
    let entry = inputs.catalog.get(&load.model)?;
    let usable = |n: &NodeId| alive.contains(n) && !load.exclude.contains(n);
    if p.stages.is_empty()
        || !p.is_valid(entry.n_layer)
        || p.context != load.context
        || p.sessions != load.sessions
        || !entry.holders.keys().any(|h| alive.contains(h))
    {
        return None;
    }
    let name = |n: &NodeId| {
        inputs.members.iter().find(|m| m.id == *n).map_or_else(|| n.to_string()[..12].to_string(), |m| m.name.clone())
    };
    let mut taken: BTreeSet<NodeId> = p.stages.iter().map(|s| s.node).filter(|n| usable(n)).collect();
    let mut out = p.clone();
    out.generation = generation;
    out.error = None;
    let mut moves = Vec::new();
    for s in &mut out.stages {
        if usable(&s.node) {
            continue;
        }
        let spare = inputs
            .members
            .iter()
            .filter(|m| usable(&m.id) && !busy.contains_key(&m.id) && !taken.contains(&m.id))
            .filter(|m| m.offer_bytes >= s.memory_bytes)
            .max_by_key(|m| (entry.holders.contains_key(&m.id), m.offer_bytes, std::cmp::Reverse(m.id)))?;
        let why = if alive.contains(&s.node) { "excluded" } else { "down" };
        moves.push(format!(
            "layers {} moved from {} ({why}) to {}, which offers {} MiB; the other stages stay where they run",
            s.layers,
            name(&s.node),
            spare.name,
            spare.offer_bytes >> 20
        ));
        taken.insert(spare.id);
        s.node = spare.id;
        // The spare's RAM holds it all (checked above): its GPUs, if any, count at the
        // next plan from scratch.
        s.gpus.clear();
    }
    out.explanation = moves.into_iter().chain(p.explanation.iter().cloned()).collect();
    Some(out)
}

/// A new placement of `load` (or one without stages, saying why not).
fn place(
    inputs: &Inputs,
    load: &LoadSpec,
    alive: &BTreeSet<NodeId>,
    busy: &BTreeMap<NodeId, &str>,
    generation: u64,
) -> ModelPlacement {
    let mut placement = ModelPlacement {
        model: load.model.clone(),
        generation,
        context: load.context,
        sessions: load.sessions,
        chunk: CHUNK.min(load.context.max(1)),
        stages: Vec::new(),
        predicted_tok_s: 0.0,
        predicted_compute_ms: 0.0,
        explanation: Vec::new(),
        error: None,
    };
    let fail = |mut p: ModelPlacement, why: String| {
        p.error = Some(why);
        p
    };
    let (Some(entry), Some(profile)) = (inputs.catalog.get(&load.model), inputs.profiles.get(&load.model)) else {
        return fail(placement, "the model is not in the catalog (or its description is missing)".into());
    };
    if !entry.holders.keys().any(|h| alive.contains(h)) {
        return fail(placement, format!("no live member holds {} (its holders are down)", entry.name));
    }
    let candidates: Vec<&MemberFacts> = inputs
        .members
        .iter()
        .filter(|m| m.alive && !load.exclude.contains(&m.id) && !busy.contains_key(&m.id))
        .collect();
    if candidates.is_empty() {
        return fail(placement, "no live member is free to run it (excluded, or running another model)".into());
    }
    let hosts = host_names(&candidates);
    let mut measured = Vec::new();
    // Each member is its CPU (with the RAM it offers) and each GPU it offers, marked
    // `offload`: the planner keeps a host's devices in a row with its GPUs after its
    // CPU, which is llama.cpp's order (it offloads a stage's *last* layers; see `merge`).
    // Where a device runs (member, GPU name or `None` for the CPU), by device id.
    let mut runs_on: BTreeMap<String, (usize, Option<String>)> = BTreeMap::new();
    let mut devices: Vec<Device> = Vec::new();
    for (i, (m, host)) in candidates.iter().zip(&hosts).enumerate() {
        let mut d = Device::estimated_cpu(host.clone(), m.offer_bytes, profile);
        let speed = inputs.speeds.get(&(m.id, load.model.clone())).filter(|s| s.is_sane());
        if let Some(speed) = speed.filter(|_| d.ms_per_layer > 0.0) {
            // The head was not timed: it scales like the layers (both read weights).
            d.head_ms *= speed.ms_per_layer / d.ms_per_layer;
            d.ms_per_layer = speed.ms_per_layer;
            d.prefill_ms_per_layer_token = Some(speed.prefill_ms_per_layer_token);
            d.estimated = false;
            measured.push(format!("{host} {:.3}", speed.ms_per_layer));
        }
        runs_on.insert(d.id.clone(), (i, None));
        devices.push(d);
        for g in &m.gpus {
            let d = Device::estimated_gpu(host.clone(), &g.device, g.memory_bytes, profile);
            if runs_on.contains_key(&d.id) {
                continue; // a member naming one GPU twice: the first counts
            }
            runs_on.insert(d.id.clone(), (i, Some(g.device.clone())));
            devices.push(d);
        }
    }
    let ids: Vec<(NodeId, String)> = candidates.iter().map(|m| m.id).zip(hosts.iter().cloned()).collect();
    let (links, wake) = measured_links(&inputs.links, &ids);
    for d in &mut devices {
        // Waking a receiver's network thread is the receiver's cost, like its compute's.
        d.wake_ms += wake.get(&d.host).copied().unwrap_or(0.0);
    }
    let mut cluster = Cluster { devices, links };
    let opts = Options {
        sizing: Sizing { context: load.context, sessions: load.sessions, chunk: placement.chunk },
        // The offer is what the node gives to models; its own reserve is outside it.
        reserve_bytes: 0,
        ..Options::default()
    };
    // Members whose GPUs were left out, and why (see `over_offer`).
    let mut left_out: Vec<String> = Vec::new();
    loop {
        let plan = match shoal_planner::plan(profile, &cluster, &opts) {
            Ok(plan) => plan,
            Err(e) => return fail(placement, e.to_string()),
        };
        let mut placed = Vec::new();
        for s in &plan.stages {
            let Some((i, gpu)) = runs_on.get(&s.device) else {
                return fail(placement, format!("the planner named an unknown device {}", s.device));
            };
            placed.push((candidates[*i].id, gpu.clone(), s));
        }
        let mut stages = merge(&placed);
        for st in &mut stages {
            let runs: Vec<_> =
                placed.iter().filter(|(n, _, _)| *n == st.node).map(|(_, g, s)| (g.clone(), *s)).collect();
            held(st, &runs, profile);
        }
        if let Some((i, why)) = over_offer(&stages, &candidates) {
            // Plan again without this member's GPUs: its layers then stay in its RAM.
            let host = &hosts[i];
            cluster.devices.retain(|d| !(d.host == *host && runs_on.get(&d.id).is_some_and(|(_, g)| g.is_some())));
            left_out.push(why);
            continue;
        }
        placement.stages = stages;
        placement.predicted_tok_s = plan.predicted_tok_s;
        placement.predicted_compute_ms = plan.stages.iter().map(|s| s.ms_per_token).sum();
        placement.explanation = plan.explanation;
        placement.explanation.extend(left_out);
        if let Some(cost) =
            shoal_types::speculative::step_cost_for(plan.predicted_tok_s, placement.predicted_compute_ms)
        {
            placement.explanation.push(format!(
                "Speculative decoding weighs each step's hops and protocol at {:.2} of a token's compute \
                 (step cost {cost}): the dearer a step, the longer the drafts worth verifying in one pass.",
                f64::from(cost) / 1000.0
            ));
        }
        if !measured.is_empty() {
            placement.explanation.push(format!(
                "Speeds measured by the members on a few layers (ms per layer and token): {}.",
                measured.join(", ")
            ));
        }
        return placement;
    }
}

/// Recompute a merged stage's GPU shares for the layers llama.cpp really puts on them
/// (`runs`: the node's planned runs, in plan order). llama.cpp offloads a stage's *last*
/// layers and always keeps the input embedding in RAM; the planner keeps a node's GPUs
/// after its CPU, but a GPU can still start the chain when its CPU takes no layer. So
/// each share holds its actual layers' blocks, never the embedding (it moves to RAM),
/// and the stage's total is unchanged but for a tied LM head on a GPU (llama.cpp copies
/// the embedding there).
fn held(stage: &mut PlacedStage, runs: &[(Option<String>, &shoal_planner::PlannedStage)], profile: &ModelProfile) {
    let blocks = |a: u32, b: u32| profile.block_bytes(shoal_types::LayerRange::new(a, b));
    let planned: Vec<&shoal_planner::PlannedStage> =
        runs.iter().filter(|(g, _)| g.is_some()).map(|(_, s)| *s).collect();
    let mut next = stage.layers.end - stage.gpu_layers().min(stage.layers.len());
    let mut added = 0u64;
    for (share, p) in stage.gpus.iter_mut().zip(planned) {
        let (a, b) = (next, next + share.layers);
        next = b;
        let mut bytes = share.memory_bytes.saturating_sub(blocks(p.first, p.last)).saturating_add(blocks(a, b));
        if p.first == 0 {
            bytes = bytes.saturating_sub(profile.embed_bytes);
            if share.head && profile.tied_embeddings {
                // The plan counted no head for a stage 0 with tied embeddings; the GPU
                // gets its own copy of the table as the LM head.
                bytes = bytes.saturating_add(profile.head_bytes);
                added = added.saturating_add(profile.head_bytes);
            }
        }
        share.memory_bytes = bytes;
    }
    stage.memory_bytes = stage.memory_bytes.saturating_add(added);
}

/// The first member (index into `members`) that a stage puts over one of its offers,
/// RAM or a GPU, and what to say about it.
fn over_offer(stages: &[PlacedStage], members: &[&MemberFacts]) -> Option<(usize, String)> {
    for s in stages.iter().filter(|s| !s.gpus.is_empty()) {
        let Some(i) = members.iter().position(|m| m.id == s.node) else { continue };
        let m = members[i];
        let over_gpu = s
            .gpus
            .iter()
            .find(|g| m.gpus.iter().find(|o| o.device == g.device).is_none_or(|o| g.memory_bytes > o.memory_bytes));
        if s.ram_bytes() > m.offer_bytes || over_gpu.is_some() {
            return Some((
                i,
                format!(
                    "{}'s GPUs left out: as llama.cpp runs a stage (its last layers on the GPU, the embedding \
                     in RAM) the plan needed {} of RAM of the {} offered{}.",
                    m.name,
                    fmt_size(s.ram_bytes()),
                    fmt_size(m.offer_bytes),
                    over_gpu.map(|g| format!(" and {} on {}", fmt_size(g.memory_bytes), g.device)).unwrap_or_default()
                ),
            ));
        }
    }
    None
}

/// The planner's stages as the nodes run them: one stage per node, its devices' runs of
/// layers joined (`placed`: each planned stage with its node and GPU, `None` for the
/// CPU), the layers on GPUs counted last, since llama.cpp offloads a model's last
/// `n_gpu_layers` layers; the order of a node's devices changes neither its compute
/// time nor what each device holds, only which of its layers go where. The head (output
/// norm and LM head) goes where the planner counted it: on the tail's last GPU when the
/// plan's last device is a GPU (llama.cpp offloads the output layer before any other),
/// else in RAM (the engine pins it there).
fn merge(placed: &[(NodeId, Option<String>, &shoal_planner::PlannedStage)]) -> Vec<PlacedStage> {
    let mut out: Vec<PlacedStage> = Vec::new();
    for (node, gpu, s) in placed {
        let layers = s.last - s.first;
        let stage = match out.last_mut() {
            Some(last) if last.node == *node => {
                last.layers = shoal_types::LayerRange::new(last.layers.start, s.last);
                last.memory_bytes += s.memory_bytes;
                last
            }
            _ => {
                out.push(PlacedStage {
                    node: *node,
                    layers: shoal_types::LayerRange::new(s.first, s.last),
                    memory_bytes: s.memory_bytes,
                    gpus: Vec::new(),
                });
                // Invariant: pushed on the line above.
                out.last_mut().expect("just pushed")
            }
        };
        if let Some(device) = gpu {
            stage.gpus.push(GpuShare { device: device.clone(), layers, head: false, memory_bytes: s.memory_bytes });
        }
    }
    let head_planned_on_gpu = placed.last().is_some_and(|(_, g, _)| g.is_some());
    if let Some(last) = out.last_mut().and_then(|tail| tail.gpus.last_mut()).filter(|_| head_planned_on_gpu) {
        last.head = true;
    }
    out
}

/// The measured links between the planned hosts (`hosts`: each member's id and host
/// name), from the members' probes: for each pair, the mean of what either side
/// measured towards the other, frames back to back (the receiver awake); pairs nobody
/// probed are left out (the planner assumes a wired LAN for them). Also, per host,
/// what waking it for a frame adds (the mean over the probes that reached it). Entries
/// probed with another model's frame size are used as they are (a frame's size matters
/// little next to the wake-ups and the link's delay).
pub fn measured_links(
    probes: &BTreeMap<NodeId, LinksEntry>,
    hosts: &[(NodeId, String)],
) -> (Vec<Link>, BTreeMap<String, f64>) {
    let mut wakes: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    // A member's figures are believed only when they make sense.
    let sane = |m: &&shoal_net::LinkMeasure| {
        let ok = |v: f64| v.is_finite() && (0.0..60_000.0).contains(&v);
        ok(m.hot_frame_ms) && ok(m.wake_ms) && m.mbit_per_s.is_finite() && m.mbit_per_s >= 0.0
    };
    for (from, probe) in probes {
        for (id, host) in hosts {
            if let Some(m) = probe.to(id).filter(|_| id != from).filter(sane) {
                wakes.entry(host).or_default().push(m.wake_ms);
            }
        }
    }
    let wake = wakes.into_iter().map(|(h, v)| (h.to_string(), v.iter().sum::<f64>() / v.len() as f64)).collect();
    let mut links = Vec::new();
    for (i, (x, hx)) in hosts.iter().enumerate() {
        for (y, hy) in &hosts[i + 1..] {
            let seen: Vec<&shoal_net::LinkMeasure> =
                [(x, y), (y, x)].iter().filter_map(|(from, to)| probes.get(from)?.to(to)).filter(sane).collect();
            if seen.is_empty() {
                continue;
            }
            let n = seen.len() as f64;
            let mbit: Vec<f64> = seen.iter().map(|l| l.mbit_per_s).filter(|b| *b > 0.0).collect();
            links.push(Link {
                hosts: [hx.clone(), hy.clone()],
                ms_per_frame: seen.iter().map(|l| l.hot_frame_ms).sum::<f64>() / n,
                mbit_per_s: (!mbit.is_empty()).then(|| mbit.iter().sum::<f64>() / mbit.len() as f64),
            });
        }
    }
    (links, wake)
}

/// The members whose links the leader should have probed before it plans: live
/// members offering memory, for every pair of which neither side measured the other,
/// one of the pair (one probe measures a member's links to all). A pair with the member
/// probing `now` is covered; a member in `tried` (probed lately, whatever came of it)
/// is not asked again, so the other end of a link it could not measure is, and a pair
/// both ends tried is left assumed. Nothing while no model is to be kept loaded.
pub fn to_probe(inputs: &Inputs, now: Option<NodeId>, tried: &BTreeSet<NodeId>) -> Vec<NodeId> {
    if inputs.loads.is_empty() {
        return Vec::new();
    }
    let offering: Vec<NodeId> = inputs.members.iter().filter(|m| m.alive && m.offer_bytes > 0).map(|m| m.id).collect();
    let measured = |a: &NodeId, b: &NodeId| inputs.links.get(a).is_some_and(|e| e.to(b).is_some());
    let mut out: Vec<NodeId> = Vec::new();
    for (i, x) in offering.iter().enumerate() {
        for y in &offering[i + 1..] {
            let covered = [x, y].iter().any(|n| Some(**n) == now || out.contains(n));
            if covered || measured(x, y) || measured(y, x) {
                continue;
            }
            if let Some(n) = [x, y].into_iter().find(|n| !tried.contains(n)) {
                out.push(*n);
            }
        }
    }
    out
}

/// Host names for the planner: member names, with an id prefix where two members
/// share a name.
fn host_names(members: &[&MemberFacts]) -> Vec<String> {
    members
        .iter()
        .map(|m| {
            if members.iter().filter(|o| o.name == m.name).count() > 1 {
                format!("{}-{}", m.name, &m.id.to_string()[..6])
            } else {
                m.name.clone()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_types::Holder;

    const MB: u64 = 1 << 20;

    fn id(n: u8) -> NodeId {
        NodeId([n; 32])
    }

    fn hash(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    /// A 30-layer model of 3 MiB per layer (about 100 MiB), held by node 1.
    fn model(n: u8) -> (CatalogEntry, ModelProfile) {
        let entry = CatalogEntry {
            name: format!("m{n}"),
            content_hash: hash(n),
            size: 100 * MB,
            arch: "llama".into(),
            n_layer: 30,
            context_length: 8192,
            quantisation: "Q4_1".into(),
            layer_period: 1,
            holders: [(id(1), Holder { path: "/m.gguf".into(), size: 100 * MB, mtime_ns: 1 })].into(),
            header_hash: None,
        };
        let profile = ModelProfile {
            layers: 30,
            layer_bytes: vec![3 * MB; 30],
            embed_bytes: 8 * MB,
            head_bytes: 8 * MB,
            tied_embeddings: true,
            other_bytes: 0,
            n_embd: 576,
            n_vocab: 49152,
            n_ff: 1536,
            period: 1,
            sliding_window: false,
            refused_stage_layers: Vec::new(),
            kv_bytes_per_token_per_layer: 1024,
        };
        (entry, profile)
    }

    /// A planned stage of `device`, layers `first..last`, taking `memory_bytes`.
    fn st(device: &str, first: u32, last: u32, memory_bytes: u64) -> shoal_planner::PlannedStage {
        shoal_planner::PlannedStage {
            device: device.into(),
            host: "h".into(),
            first,
            last,
            memory_bytes,
            ms_per_token: 1.0,
        }
    }

    fn member(n: u8, offer: u64) -> MemberFacts {
        MemberFacts { id: id(n), name: format!("n{n}"), alive: true, offer_bytes: offer, gpus: Vec::new() }
    }

    fn inputs(offers: &[u64]) -> Inputs {
        let (entry, profile) = model(1);
        Inputs {
            loads: vec![LoadSpec { model: hash(1), context: 256, sessions: 1, exclude: vec![] }],
            catalog: [(hash(1), entry)].into(),
            profiles: [(hash(1), profile)].into(),
            placements: BTreeMap::new(),
            members: offers.iter().enumerate().map(|(i, o)| member(i as u8 + 1, *o)).collect(),
            idle: BTreeSet::new(),
            speeds: BTreeMap::new(),
            measuring: BTreeSet::new(),
            links: BTreeMap::new(),
            probing: BTreeSet::new(),
            returning: BTreeSet::new(),
            index: 0,
        }
    }

    /// Apply `decisions` to `inputs`' placements, as the commit would.
    fn commit(inputs: &mut Inputs, decisions: Vec<Decision>) {
        for d in decisions {
            match d {
                Decision::Place(p) => {
                    inputs.placements.insert(p.model.clone(), p);
                }
                Decision::Remove(m) => {
                    inputs.placements.remove(&m);
                }
            }
        }
    }

    /// Schedule and commit once.
    fn step(inputs: &mut Inputs) {
        let d = schedule(inputs);
        commit(inputs, d);
    }

    fn placed(inputs: &Inputs) -> &ModelPlacement {
        &inputs.placements[&hash(1)]
    }

    #[test]
    fn a_model_too_big_for_each_member_is_split_over_them_and_then_kept() {
        // About 100 MiB of weights plus buffers; 60 MiB each: no one or two hold it.
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        let d = schedule(&i);
        assert_eq!(d.len(), 1);
        commit(&mut i, d);
        let p = placed(&i);
        assert_eq!(p.error, None, "{:?}", p.explanation);
        assert_eq!(p.stages.len(), 3, "{:?}", p.stages);
        assert!(p.is_valid(30));
        assert_eq!(p.generation, 1);
        assert!(p.stages.iter().all(|s| s.memory_bytes <= 90 * MB));
        // Nothing changed: nothing to do (no re-plan, no new generation).
        assert!(schedule(&i).is_empty());
        // Unloaded and loaded again later: a generation never seen before.
        i.loads.clear();
        step(&mut i);
        assert!(i.placements.is_empty());
        i.loads = inputs(&[]).loads;
        i.index = 7;
        step(&mut i);
        assert_eq!(placed(&i).generation, 8);
        assert!(schedule(&i).is_empty());
    }

    fn speed(ms_per_layer: f64) -> Speed {
        Speed {
            ms_per_layer,
            prefill_ms_per_layer_token: ms_per_layer / 4.0,
            layers: shoal_types::LayerRange::new(1, 3),
            fingerprint: String::new(),
        }
    }

    #[test]
    fn the_plan_puts_the_model_on_the_member_measured_fastest_and_says_so() {
        for fast in [1u8, 2] {
            // Both could hold the whole model; only their measured speeds differ.
            let mut i = inputs(&[400 * MB, 400 * MB]);
            for n in [1u8, 2] {
                i.speeds.insert((id(n), hash(1)), speed(if n == fast { 0.1 } else { 0.8 }));
            }
            step(&mut i);
            let p = placed(&i);
            assert_eq!(p.stages.len(), 1, "{:?}", p.explanation);
            assert_eq!(p.stages[0].node, id(fast), "{:?}", p.explanation);
            // 30 layers at 0.1 ms and the head scaled alike: about 300 tok/s, where
            // the estimate (20 GB/s over ~100 MiB) says about 190.
            assert!(p.predicted_tok_s > 250.0 && p.predicted_tok_s < 340.0, "{}", p.predicted_tok_s);
            let text = p.explanation.join("\n");
            assert!(
                text.contains("Speeds measured by the members") && text.contains("n1 0.") && text.contains("n2 0."),
                "{text}"
            );
            assert!(!text.contains("estimated"), "{text}");
            // One stage: a token's predicted time is (nearly) all compute, and the
            // step cost speculation gets from it is small and said.
            let token_ms = 1000.0 / p.predicted_tok_s;
            assert!(p.predicted_compute_ms > 0.5 * token_ms && p.predicted_compute_ms <= token_ms + 1e-9, "{p:?}");
            let cost = shoal_types::speculative::step_cost_for(p.predicted_tok_s, p.predicted_compute_ms).unwrap();
            assert!(cost < 1000 && text.contains(&format!("(step cost {cost})")), "{text}");
        }
        // A member's entry that makes no sense is not believed: estimated, and said so.
        let mut i = inputs(&[400 * MB]);
        i.speeds.insert((id(1), hash(1)), speed(f64::NAN));
        step(&mut i);
        assert!(placed(&i).explanation.join("\n").contains("estimated"), "{:?}", placed(&i).explanation);
    }

    fn probe(peers: &[(u8, f64)]) -> LinksEntry {
        let m = |ms: f64| shoal_net::LinkMeasure {
            rtt_ms: 2.0 * ms,
            frame_ms: ms + 0.5,
            hot_frame_ms: ms,
            wake_ms: 0.5,
            frame_bytes: 2304,
            idle_ms: 10.0,
            mbit_per_s: 100.0,
            samples: 21,
        };
        LinksEntry { frame_bytes: 2304, peers: peers.iter().map(|&(n, ms)| (id(n).to_string(), m(ms))).collect() }
    }

    #[test]
    fn links_are_probed_once_per_unmeasured_pair_and_planned_with() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB, 0]);
        let none = BTreeSet::new();
        // Nobody measured anything: 1 probes (covering 1-2, 1-3), then 2 (for 2-3).
        // Member 4 offers nothing: it is never planned, so never probed.
        assert_eq!(to_probe(&i, None, &none), vec![id(1), id(2)]);
        // 1 probing now: 2 still has 2-3 to cover.
        assert_eq!(to_probe(&i, Some(id(1)), &none), vec![id(2)]);
        // 1 probed and could not reach 2 (its entry lacks 2): 2 probes that link; when
        // both tried, the link is left assumed rather than probed again and again.
        i.links.insert(id(1), probe(&[(3, 6.0)]));
        assert_eq!(to_probe(&i, None, &[id(1)].into()), vec![id(2)]);
        // Both tried: 1-2 is left assumed; 2-3 falls to 3.
        assert_eq!(to_probe(&i, None, &[id(1), id(2)].into()), vec![id(3)]);
        assert!(to_probe(&i, None, &[id(1), id(2), id(3)].into()).is_empty());
        i.links.insert(id(1), probe(&[(2, 4.0), (3, 6.0)]));
        assert_eq!(to_probe(&i, None, &none), vec![id(2)]);
        i.links.insert(id(3), probe(&[(2, 8.0)]));
        assert!(to_probe(&i, None, &none).is_empty());
        // No load, no probes.
        let mut idle = i.clone();
        idle.links.clear();
        idle.loads.clear();
        assert!(to_probe(&idle, None, &none).is_empty());
        // A member's nonsense is not believed: that link stays unmeasured.
        let mut bad = probe(&[(2, 4.0)]);
        bad.peers.values_mut().for_each(|m| m.hot_frame_ms = f64::NAN);
        let (links, _) = measured_links(&[(id(1), bad)].into(), &[(id(1), "n1".into()), (id(2), "n2".into())]);
        assert!(links.is_empty(), "{links:?}");
        // While a probe is awaited, nothing is planned from scratch.
        i.probing = [id(2)].into();
        assert!(schedule(&i).is_empty());
        i.probing.clear();
        // The plan uses every pair's measured link (2-3 measured from 3's side), and
        // the receivers' wake-ups: no assumed link left in the explanation.
        let hosts: Vec<(NodeId, String)> = (1..=3).map(|n| (id(n), format!("n{n}"))).collect();
        let (links, wake) = measured_links(&i.links, &hosts);
        let ms: Vec<(String, f64)> = links.iter().map(|l| (l.hosts.join("-"), l.ms_per_frame)).collect();
        assert_eq!(ms, [("n1-n2".to_string(), 4.0), ("n1-n3".into(), 6.0), ("n2-n3".into(), 8.0)]);
        assert_eq!(wake.get("n2"), Some(&0.5));
        assert_eq!(wake.get("n1"), None, "nobody probed n1");
        step(&mut i);
        let p = placed(&i);
        assert_eq!(p.stages.len(), 3);
        let text = p.explanation.join("\n");
        assert!(!text.contains("No measured link"), "{text}");
        // Slow links cost: about 30 layers of ~0.15 ms plus three hops of 4-8 ms.
        assert!(p.predicted_tok_s < 70.0, "{}", p.predicted_tok_s);
    }

    #[test]
    fn a_model_is_first_planned_once_the_awaited_measurements_are_in() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        // Every member is free and unmeasured: all three are to be asked.
        assert_eq!(to_measure(&i), vec![(id(1), hash(1)), (id(2), hash(1)), (id(3), hash(1))]);
        i.measuring = [(id(2), hash(1))].into();
        assert_eq!(to_measure(&i), vec![(id(1), hash(1)), (id(3), hash(1))]);
        assert!(schedule(&i).is_empty(), "planned while a measurement runs");
        assert!(better_if_idle(&i).is_empty());
        // Answered (or given up on): planned.
        i.measuring.clear();
        for n in 1..=3 {
            i.speeds.insert((id(n), hash(1)), speed(0.5));
        }
        assert!(to_measure(&i).is_empty());
        step(&mut i);
        let p = placed(&i).clone();
        assert_eq!(p.stages.len(), 3);
        // A member that joins later is measured (it runs nothing); the members running
        // stages are not (a measurement would slow their generations). Nor are members
        // that are down or offer nothing.
        i.members.push(member(4, 90 * MB));
        i.members.push(member(5, 0));
        i.members.push(MemberFacts { alive: false, ..member(6, 90 * MB) });
        i.speeds.clear();
        assert_eq!(to_measure(&i), vec![(id(4), hash(1))]);
        // A kept placement does not wait for measurements, and a lost stage is repaired
        // at once: only a plan from scratch waits.
        i.measuring = [(id(4), hash(1))].into();
        assert!(schedule(&i).is_empty());
        i.members.iter_mut().find(|m| m.id == p.stages[1].node).unwrap().alive = false;
        step(&mut i);
        assert_eq!(placed(&i).stages[1].node, id(4), "{:?}", placed(&i).stages);
    }

    #[test]
    fn a_down_stage_node_is_replaced_by_a_spare_and_a_newer_generation() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        let before = placed(&i).clone();
        let victim = before.stages[before.stages.len() / 2].node;
        i.members.iter_mut().find(|m| m.id == victim).unwrap().alive = false;
        step(&mut i);
        let after = placed(&i);
        assert_eq!(after.generation, 2);
        assert!(after.is_valid(30));
        assert!(after.stages.iter().all(|s| s.node != victim), "{:?}", after.stages);
        // Repaired, not re-planned: the same layers, only the lost stage moved.
        for (a, b) in before.stages.iter().zip(&after.stages) {
            assert_eq!(a.layers, b.layers);
            assert_eq!(a.node == b.node, a.node != victim, "{:?} -> {:?}", before.stages, after.stages);
        }
        assert!(after.explanation[0].contains("(down)"), "{:?}", after.explanation);
        // A member coming back does not interrupt the working placement.
        i.members.iter_mut().find(|m| m.id == victim).unwrap().alive = true;
        assert!(schedule(&i).is_empty());
    }

    #[test]
    fn a_lost_stage_goes_to_a_spare_that_holds_the_model_and_without_a_big_enough_spare_the_model_is_replanned() {
        // Five members: three run the model; of the two spares, 5 holds the model.
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        let before = placed(&i).clone();
        let spares: Vec<NodeId> =
            i.members.iter().map(|m| m.id).filter(|n| before.stages.iter().all(|s| s.node != *n)).collect();
        assert_eq!(spares.len(), 2);
        let holder = *spares.iter().max().unwrap();
        let copy = Holder { path: "/copy.gguf".into(), size: 100 * MB, mtime_ns: 1 };
        i.catalog.get_mut(&hash(1)).unwrap().holders.insert(holder, copy);
        let victim = before.stages.iter().map(|s| s.node).find(|n| *n != id(1)).unwrap();
        i.members.iter_mut().find(|m| m.id == victim).unwrap().alive = false;
        step(&mut i);
        let after = placed(&i).clone();
        let moved = before.stages.iter().zip(&after.stages).find(|(a, _)| a.node == victim).unwrap().1;
        assert_eq!(moved.node, holder, "the spare holding the model: {:?}", after.stages);
        // The last spare is too small for the stage lost next: planned from scratch on
        // the members left, which cannot hold the model (it says so).
        let small = *spares.iter().min().unwrap();
        i.members.iter_mut().find(|m| m.id == small).unwrap().offer_bytes = 10 * MB;
        let victim = after.stages.iter().map(|s| s.node).find(|n| *n != id(1)).unwrap();
        i.members.iter_mut().find(|m| m.id == victim).unwrap().alive = false;
        step(&mut i);
        let last = placed(&i);
        assert!(last.stages.is_empty() && last.error.is_some(), "{last:?}");
    }

    #[test]
    fn a_big_member_joining_moves_an_idle_model_to_a_clearly_better_plan_and_never_a_busy_one() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        let before = placed(&i).clone();
        assert_eq!(before.stages.len(), 3);
        // A member that holds the whole model joins.
        i.members.push(member(9, 1024 * MB));
        // Busy (or not known to be idle): kept as it is.
        assert!(schedule(&i).is_empty());
        assert_eq!(better_if_idle(&i), [hash(1)].into());
        // Idle: one stage on the big member, a new generation, and why.
        i.idle.insert(hash(1));
        step(&mut i);
        let after = placed(&i).clone();
        assert_eq!(after.stages.len(), 1, "{:?}", after.stages);
        assert_eq!(after.stages[0].node, id(9));
        assert!(after.generation > before.generation);
        assert!(after.predicted_tok_s >= REPLAN_GAIN * before.predicted_tok_s);
        assert!(after.explanation[0].starts_with("re-planned while idle"), "{:?}", after.explanation);
        // Stable: the same inputs re-plan nothing more.
        assert!(schedule(&i).is_empty());
        assert!(better_if_idle(&i).is_empty());
        // A member no better than the others changes nothing, idle or not.
        i.members.push(member(10, 90 * MB));
        assert!(schedule(&i).is_empty());
    }

    #[test]
    fn a_model_that_no_longer_fits_says_why_and_comes_back_with_its_members() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        i.members[2].alive = false;
        step(&mut i);
        let p = placed(&i).clone();
        assert!(p.stages.is_empty());
        assert!(p.error.as_deref().is_some_and(|e| e.contains("does not fit")), "{:?}", p.error);
        // The same refusal is not committed again and again.
        assert!(schedule(&i).is_empty());
        i.members[2].alive = true;
        step(&mut i);
        assert_eq!(placed(&i).stages.len(), 3);
        assert!(placed(&i).generation > p.generation);
    }

    #[test]
    fn a_placement_with_no_spare_waits_for_a_member_that_may_come_back_then_says_why() {
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        let before = placed(&i).clone();
        assert_eq!(before.stages.len(), 3);
        // A lid closes on node 3: down, within the grace. Nothing changes, however
        // often the leader asks.
        i.members[2].alive = false;
        i.returning.insert(id(3));
        assert!(schedule(&i).is_empty(), "{:?}", schedule(&i));
        // Its nodes stay taken: another model is not planned onto them meanwhile.
        let (entry, profile) = model(2);
        i.catalog.insert(hash(2), entry);
        i.profiles.insert(hash(2), profile);
        i.loads.push(LoadSpec { model: hash(2), context: 256, sessions: 1, exclude: vec![] });
        i.members.push(member(4, 300 * MB));
        // (Not a spare for the first: the owner keeps it off that model.)
        i.loads[0].exclude = vec![id(4)];
        step(&mut i);
        let other = &i.placements[&hash(2)];
        assert!(other.stages.iter().all(|s| s.node == id(4)), "{:?}", other.stages);
        assert_eq!(placed(&i), &before);
        // Back: the same placement runs on, no new generation.
        i.members[2].alive = true;
        i.returning.clear();
        assert!(schedule(&i).is_empty());
        // Down past the grace: planned from scratch, which cannot place it, and says so.
        i.members[2].alive = false;
        step(&mut i);
        let p = placed(&i);
        assert!(p.stages.is_empty() && p.error.as_deref().is_some_and(|e| e.contains("does not fit")), "{p:?}");
        // A member that was removed from the cluster is not waited for either.
        let mut i = inputs(&[90 * MB, 90 * MB, 90 * MB]);
        step(&mut i);
        i.members.remove(2);
        i.returning.insert(id(3));
        step(&mut i);
        assert!(placed(&i).stages.is_empty());
    }

    #[test]
    fn excluded_nodes_and_down_holders_are_respected() {
        let mut i = inputs(&[200 * MB, 200 * MB]);
        i.loads[0].exclude = vec![id(1)];
        step(&mut i);
        assert_eq!(placed(&i).stages.iter().map(|s| s.node).collect::<Vec<_>>(), vec![id(2)]);
        // The only holder (node 1) down: no placement, and the reason.
        i.members[0].alive = false;
        i.loads[0].exclude.clear();
        i.placements.clear();
        step(&mut i);
        assert!(placed(&i).error.as_deref().is_some_and(|e| e.contains("holds")), "{:?}", placed(&i).error);
    }

    #[test]
    fn two_models_never_share_a_node_and_unloading_removes_the_placement() {
        let mut i = inputs(&[200 * MB, 200 * MB]);
        let (entry, profile) = model(2);
        i.catalog.insert(hash(2), entry);
        i.profiles.insert(hash(2), profile);
        i.loads.push(LoadSpec { model: hash(2), context: 256, sessions: 1, exclude: vec![] });
        step(&mut i);
        let a: Vec<NodeId> = i.placements[&hash(1)].stages.iter().map(|s| s.node).collect();
        let b: Vec<NodeId> = i.placements[&hash(2)].stages.iter().map(|s| s.node).collect();
        assert_eq!((a.len(), b.len()), (1, 1));
        assert_ne!(a, b);
        i.loads.retain(|l| l.model != hash(2));
        assert_eq!(schedule(&i), vec![Decision::Remove(hash(2))]);
    }

    #[test]
    fn a_members_gpus_are_devices_of_the_plan_and_its_devices_one_stage() {
        // Node 1 offers 60 MiB of RAM and two GPUs; node 2 90 MiB of RAM. The GPUs
        // (estimated far faster) take what they hold; node 1 runs one stage with its
        // CPU's layers first and its GPUs' last, as llama.cpp offloads.
        let mut i = inputs(&[60 * MB, 90 * MB]);
        i.members[0].gpus = vec![
            GpuOffer { device: "CUDA0".into(), description: "a".into(), memory_bytes: 120 * MB },
            GpuOffer { device: "CUDA1".into(), description: "b".into(), memory_bytes: 100 * MB },
        ];
        step(&mut i);
        let p = placed(&i).clone();
        assert_eq!(p.error, None, "{:?}", p.explanation);
        assert!(p.is_valid(30), "{:?}", p.stages);
        let on_1 = p.stages.iter().find(|s| s.node == id(1)).expect("node 1 runs a stage");
        let names: Vec<&str> = on_1.gpus.iter().map(|g| g.device.as_str()).collect();
        assert_eq!(names.len(), 2, "both GPUs used: {:?}", p.stages);
        assert!(names.contains(&"CUDA0") && names.contains(&"CUDA1"));
        assert!(on_1.gpus.iter().all(|g| g.layers > 0));
        let vram = |d: &str| on_1.gpus.iter().find(|g| g.device == d).map_or(0, |g| g.memory_bytes);
        assert!(vram("CUDA0") <= 120 * MB && vram("CUDA1") <= 100 * MB, "{:?}", on_1.gpus);
        assert!(on_1.ram_bytes() <= 60 * MB, "{on_1:?}");
        assert!(p.explanation.iter().any(|l| l.contains("n1/CUDA0's speed is estimated")), "{:?}", p.explanation);
        // The same cluster without GPUs cannot use node 1's VRAM: a slower plan.
        let mut cpu_only = inputs(&[60 * MB, 90 * MB]);
        step(&mut cpu_only);
        assert!(placed(&cpu_only).predicted_tok_s < p.predicted_tok_s);
        // Node 1 goes down: its stage moves to a spare's CPU whole (the spare's GPUs, if
        // it had any, count at the next plan from scratch).
        i.members.push(member(3, 200 * MB));
        i.members[0].alive = false;
        let copy = Holder { path: "/m.gguf".into(), size: 100 * MB, mtime_ns: 1 };
        i.catalog.get_mut(&hash(1)).unwrap().holders.insert(id(2), copy);
        step(&mut i);
        let moved = placed(&i);
        assert!(moved.is_valid(30), "{:?}", moved.stages);
        assert!(moved.stages.iter().all(|s| s.node != id(1) && s.gpus.is_empty()), "{:?}", moved.stages);
    }

    #[test]
    fn a_gpu_planned_first_holds_the_stages_last_layers_and_no_embedding_and_over_an_offer_is_left_out() {
        // Layers 0-9 of 1 MB, 10-29 of 3 MB; the plan: node 1's GPU first (stage 0,
        // the 8 MB embedding counted there), then its CPU.
        let (_, mut profile) = model(1);
        profile.layer_bytes = [vec![MB; 10], vec![3 * MB; 20]].concat();
        let (gpu, cpu) = (st("n1/CUDA0", 0, 10, 10 * MB + 8 * MB + 5 * MB), st("n1/cpu", 10, 30, 60 * MB + 5 * MB));
        let runs = [(Some("CUDA0".to_string()), &gpu), (None, &cpu)];
        let mut stages = merge(&[(id(1), Some("CUDA0".into()), &gpu), (id(1), None, &cpu)]);
        let total = stages[0].memory_bytes;
        held(&mut stages[0], &runs, &profile);
        // llama.cpp puts layers 20-29 (30 MB) on the GPU, and the embedding in RAM.
        assert_eq!(stages[0].gpus[0].memory_bytes, 30 * MB + 5 * MB);
        assert_eq!(stages[0].memory_bytes, total);
        assert_eq!(stages[0].ram_bytes(), total - 35 * MB);
        // Node 1 offering 50 MiB of RAM and a 100 MiB GPU: with the embedding and the
        // small layers in RAM (53 MiB), the RAM is over.
        assert_eq!(stages[0].ram_bytes(), 53 * MB);
        let mut m = member(1, 50 * MB);
        m.gpus = vec![GpuOffer { device: "CUDA0".into(), description: String::new(), memory_bytes: 100 * MB }];
        let (i, why) = over_offer(&stages, &[&m]).expect("over the RAM offer");
        assert_eq!(i, 0);
        assert!(why.contains("n1's GPUs left out") && why.contains("53.0 MiB of RAM of the 50.0 MiB offered"), "{why}");
        m.offer_bytes = 200 * MB;
        assert!(over_offer(&stages, &[&m]).is_none());
        m.gpus[0].memory_bytes = 20 * MB;
        assert!(over_offer(&stages, &[&m]).unwrap().1.contains("on CUDA0"));
    }

    #[test]
    fn merged_stages_offload_their_last_layers_and_the_head_where_it_was_planned() {
        let (cpu, g0, g1, other) =
            (st("a/cpu", 0, 4, 10), st("a/g0", 4, 20, 50), st("a/g1", 20, 30, 40), st("b/cpu", 20, 30, 40));
        // Node a: its CPU then two GPUs, the tail: one stage, the head on g1 as planned.
        let merged = merge(&[(id(1), None, &cpu), (id(1), Some("g0".into()), &g0), (id(1), Some("g1".into()), &g1)]);
        assert_eq!(merged.len(), 1);
        let s = &merged[0];
        assert_eq!((s.layers, s.memory_bytes, s.gpu_layers()), (shoal_types::LayerRange::new(0, 30), 100, 26));
        assert_eq!(
            s.gpus.iter().map(|g| (g.layers, g.head, g.memory_bytes)).collect::<Vec<_>>(),
            [(16, false, 50), (10, true, 40)]
        );
        assert_eq!(s.ram_bytes(), 10);
        // The plan's tail on the node's CPU: its GPU still takes the stage's last layers
        // (llama.cpp offloads the last ones), the head stays in RAM, where it was counted.
        let merged =
            merge(&[(id(1), Some("g0".into()), &st("a/g0", 0, 26, 90)), (id(1), None, &st("a/cpu", 26, 30, 10))]);
        assert_eq!(merged[0].layers, shoal_types::LayerRange::new(0, 30));
        assert_eq!(merged.len(), 1);
        assert_eq!((merged[0].gpu_layers(), merged[0].gpus[0].head, merged[0].ram_bytes()), (26, false, 10));
        // Two nodes: two stages; the head planned on a CPU stays there.
        let merged = merge(&[(id(1), Some("g0".into()), &st("a/g0", 0, 20, 50)), (id(2), None, &other)]);
        assert_eq!(merged.len(), 2);
        assert_eq!((merged[0].gpu_layers(), merged[0].gpus[0].head, merged[1].gpus.len()), (20, false, 0));
    }
}
