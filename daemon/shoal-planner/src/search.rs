//! The planner's search: the fastest chain of devices and layer split that fits, by
//! dynamic programming over the units of layers placed so far, instead of enumerating
//! every ordered chain (which grows factorially: 9 devices were the limit).
//!
//! Why a DP is exact here. The latency model (see [`crate::plan`]) adds up, per
//! stage, its layers × the device's ms per layer plus the wake-up cost of the device
//! that receives its input, plus the head on the tail, plus one link per hop. A
//! stage's memory limit depends only on its role (stage 0, tail, or middle: see
//! [`Problem::capacity`]), not on where in the middle it sits. So a chain built stage
//! by stage, left to right, needs to remember only how many units it has placed
//! (`x`), which host it is on (for the next link) and, for the explanation's queries,
//! whether it has used a required device. A stage of `u` units costs `u × w` with
//! `w` fixed per device, so each device's transitions `y → x` are a sliding-window
//! minimum: O(units) per device.
//!
//! Hosts are visited in blocks (one host's devices adjacent). Within a block the
//! order of middle devices does not matter, so blocks are run in cluster order, with
//! each candidate for stage 0 moved to the front of the first block and each
//! candidate for the tail moved to the back (a pinned host tries every order of its
//! devices, since pins fix positions); an offloading GPU never precedes its host's
//! other devices (`Device::offload`). Between blocks, the cost of the ring of hosts
//! does depend on their order: up to [`EXACT_HOSTS`] hosts every order is covered (a
//! DP over the set of hosts visited, as in Held–Karp); beyond, the hosts are visited
//! as a subsequence of a short tour (nearest neighbour, then 2-opt) and the hosts the
//! best chain uses are then reordered and searched again. Links on a LAN are close
//! to uniform, where every order costs the same and the result is still exact.
//!
//! Pure: no I/O, no clock, no randomness, no threads.

use crate::plan::{preferred, Candidate, Problem};
use std::cmp::Ordering;
use std::collections::VecDeque;

/// What a search may use.
pub(crate) struct Constraint {
    /// Devices it may place on.
    pub(crate) allowed: Vec<bool>,
    /// A device every placement must include (the explanation's "best with d").
    pub(crate) required: Option<usize>,
}

impl Constraint {
    /// Every device, nothing required.
    pub(crate) fn all(devices: usize) -> Self {
        Constraint { allowed: vec![true; devices], required: None }
    }
}

/// Hosts up to which every order of hosts is searched (Held–Karp over host sets:
/// `hosts × (hosts−1) × 2^(hosts−2)` blocks per search).
pub(crate) const EXACT_HOSTS: usize = 6;
/// Devices of a pinned host up to which every order of them is tried.
const EXACT_PINNED_DEVICES: usize = 5;
/// Reorder-and-search-again rounds after the first pass, on many hosts.
const REORDER_ROUNDS: usize = 3;

const NONE: u32 = u32::MAX;

/// The best partial chain reaching a state: its cost, the tie-breakers of
/// [`crate::plan`] (fewer hosts, then fewer stages), and its last stage in the arena.
#[derive(Clone, Copy, Debug)]
struct Cell {
    ms: f64,
    hosts: u32,
    stages: u32,
    node: u32,
}

/// Unreached (`hosts == 0`: every reached state is on a host).
const EMPTY: Cell = Cell { ms: f64::INFINITY, hosts: 0, stages: 0, node: NONE };

impl Cell {
    fn reached(&self) -> bool {
        self.hosts > 0
    }

    /// A total order (exact on ms), so that sliding-window minima are well defined.
    fn cmp_key(&self, other: &Cell) -> Ordering {
        self.ms.total_cmp(&other.ms).then((self.hosts, self.stages).cmp(&(other.hosts, other.stages)))
    }

    fn beats(&self, other: &Cell) -> bool {
        self.reached() && (!other.reached() || self.cmp_key(other) == Ordering::Less)
    }
}

/// One stage of a partial chain: `device` holds units from `from` to the next
/// stage's `from` (or the end); `prev` is the stage before it.
struct Node {
    device: u32,
    from: u32,
    prev: u32,
}

/// States by units placed `x` and whether the required device is in: `x * 2 + r`.
type Layer = Vec<Cell>;

fn at(x: u32, r: usize) -> usize {
    x as usize * 2 + r
}

/// One search's tables.
struct Dp<'s, 'a> {
    p: &'s Problem<'a>,
    c: &'s Constraint,
    units: u32,
    /// 2 when a device is required (states with and without it), else 1.
    flags: usize,
    /// Each device's pin, in units.
    pin_of: Vec<Option<(u32, u32)>>,
    /// Per unit: whether a pin holds it (no other device may).
    pinned: Vec<bool>,
    /// Per unit: the first unit of the run of unpinned units it is in.
    run_start: Vec<u32>,
    arena: Vec<Node>,
    /// The best chain found so far.
    best: Option<Candidate>,
}

/// The fastest placement under `c` that honours `pins` (device, first unit, end
/// unit), or `None` when none fits.
pub(crate) fn best(p: &Problem<'_>, pins: &[(usize, u32, u32)], c: &Constraint) -> Option<Candidate> {
    let units = p.units;
    let mut pin_of = vec![None; p.devices.len()];
    let mut pinned = vec![false; units as usize];
    for &(d, a, b) in pins {
        if !c.allowed[d] {
            return None;
        }
        pin_of[d] = Some((a, b));
        for u in a..b.min(units) {
            pinned[u as usize] = true;
        }
    }
    let mut run_start = vec![0u32; units as usize];
    let mut start = 0;
    for u in 0..units {
        if pinned[u as usize] {
            start = u + 1;
        }
        run_start[u as usize] = start;
    }
    let flags = if c.required.is_some() { 2 } else { 1 };
    let mut dp = Dp { p, c, units, flags, pin_of, pinned, run_start, arena: Vec::new(), best: None };
    dp.single_devices(pins);
    let hosts: Vec<usize> = (0..p.hosts.len()).filter(|&h| p.host_devices[h].iter().any(|&d| c.allowed[d])).collect();
    if hosts.len() <= EXACT_HOSTS {
        for &hf in &hosts {
            dp.every_order_from(hf, &hosts);
        }
    } else {
        let tour = tour(p, &hosts);
        let mut orders = vec![tour.clone(), tour.iter().rev().copied().collect()];
        if !pins.is_empty() {
            // Pins fix the order of their hosts: visit those first, in pin order.
            let mut pinned_hosts: Vec<(u32, usize)> = pins.iter().map(|&(d, a, _)| (a, p.host_of[d])).collect();
            pinned_hosts.sort_unstable();
            let mut order: Vec<usize> = Vec::new();
            for (_, h) in pinned_hosts.into_iter().chain(tour.iter().map(|&h| (0, h))) {
                if !order.contains(&h) {
                    order.push(h);
                }
            }
            orders.push(order);
        }
        for order in &orders {
            dp.subsequences_of(order);
        }
        // The first pass visits hosts in the tour's order; the best chain's own hosts
        // may have a cheaper order, and with it other hosts may pay off.
        for _ in 0..REORDER_ROUNDS {
            let Some(b) = &dp.best else { break };
            let mut used: Vec<usize> = b.chain.iter().map(|&d| p.host_of[d]).collect();
            used.dedup();
            let better = cheapest_path(p, &used);
            if better == used || !pins.is_empty() {
                break;
            }
            let before = b.decode_ms;
            let mut order = better;
            order.extend(tour.iter().filter(|h| !used.contains(h)));
            dp.subsequences_of(&order);
            if dp.best.as_ref().is_none_or(|b| b.decode_ms >= before) {
                break;
            }
        }
    }
    dp.best
}

/// Whether any placement without pins fits under `c`: the same memory limits as
/// the search, without its costs. A chain of two or more needs a stage 0 and a tail
/// on different devices (on different hosts, unless every device is on one host),
/// and together with middle stages of any other devices enough room for every unit;
/// host order never matters for room.
pub(crate) fn fits(p: &Problem<'_>, c: &Constraint) -> bool {
    let u = p.units;
    let ok = |d: usize| c.allowed[d];
    let required_in = |set: &dyn Fn(usize) -> bool| c.required.is_none_or(set);
    for d in (0..p.devices.len()).filter(|&d| ok(d)) {
        if p.capacity(d, true, true) >= u && required_in(&|r| r == d) {
            return true;
        }
    }
    if u < 2 {
        return false;
    }
    let mid = |d: usize| u64::from(p.capacity(d, false, false));
    for f in (0..p.devices.len()).filter(|&d| ok(d) && p.capacity(d, true, false) > 0) {
        for t in (0..p.devices.len()).filter(|&d| d != f && ok(d) && p.capacity(d, false, true) > 0) {
            let same = p.host_of[f] == p.host_of[t];
            let usable = |d: usize| ok(d) && d != f && d != t && (!same || p.host_of[d] == p.host_of[f]);
            if !required_in(&|r| r == f || r == t || (usable(r) && mid(r) > 0)) {
                continue;
            }
            let room = u64::from(p.capacity(f, true, false).min(u - 1))
                + u64::from(p.capacity(t, false, true))
                + (0..p.devices.len()).filter(|&d| usable(d)).map(mid).sum::<u64>();
            if room >= u64::from(u) {
                return true;
            }
        }
    }
    false
}

impl Dp<'_, '_> {
    fn consider(&mut self, cand: Candidate) {
        if self.best.as_ref().is_none_or(|b| preferred(&cand, b)) {
            self.best = Some(cand);
        }
    }

    /// Chains of one device: no hops, no wake-ups (the DP builds chains of two or more).
    fn single_devices(&mut self, pins: &[(usize, u32, u32)]) {
        let p = self.p;
        for d in 0..p.devices.len() {
            let whole = pins.iter().all(|&(pd, a, b)| pd == d && a == 0 && b == self.units);
            if self.c.allowed[d]
                && whole
                && self.c.required.is_none_or(|r| r == d)
                && p.capacity(d, true, true) >= self.units
            {
                self.consider(p.candidate(vec![d], vec![0, p.model.layers]));
            }
        }
    }

    fn layer(&self) -> Layer {
        vec![EMPTY; (self.units as usize + 1) * 2]
    }

    /// The start: nothing placed, on the first host.
    fn origin(&self) -> Layer {
        let mut l = self.layer();
        l[at(0, 0)] = Cell { ms: 0.0, hosts: 1, stages: 0, node: NONE };
        l
    }

    /// Model time of device `d` holding units `y..x` (with its wake-up; the head if
    /// it is the tail).
    fn stage_ms(&self, d: usize, y: u32, x: u32) -> f64 {
        let dev = self.p.devices[d];
        let layers = self.p.unit_range(0, x).end - self.p.unit_range(0, y).end;
        let head = if x == self.units { dev.head_ms } else { 0.0 };
        f64::from(layers) * dev.ms_per_layer + dev.wake() + head
    }

    /// Offer "device `d` holds `y..x`" from `src[y, r]` to `dst[x, r2]`.
    #[allow(clippy::too_many_arguments)]
    fn offer(&mut self, src: &[Cell], y: u32, r: usize, dst: &mut [Cell], x: u32, r2: usize, ms: f64, d: usize) {
        let s = src[at(y, r)];
        if !s.reached() {
            return;
        }
        let cand = Cell { ms: s.ms + ms, hosts: s.hosts, stages: s.stages + 1, node: NONE };
        if cand.beats(&dst[at(x, r2)]) {
            self.arena.push(Node { device: d as u32, from: y, prev: s.node });
            dst[at(x, r2)] = Cell { node: (self.arena.len() - 1) as u32, ..cand };
        }
    }

    /// Every stage device `d` can add after the states in `src` (`extra`: the link
    /// into it), improving `dst`.
    fn relax(&mut self, src: &[Cell], extra: f64, d: usize, dst: &mut [Cell]) {
        let (p, u) = (self.p, self.units);
        let req = usize::from(self.c.required == Some(d));
        if let Some((a, b)) = self.pin_of[d] {
            let (first, tail) = (a == 0, b == u);
            if !(first && tail) && b - a <= p.capacity(d, first, tail) {
                let ms = self.stage_ms(d, a, b) + extra;
                for r in 0..self.flags {
                    self.offer(src, a, r, dst, b, r | req, ms, d);
                }
            }
            return;
        }
        // Stage 0 (only the first block starts at 0).
        if src[at(0, 0)].reached() {
            for x in 1..=p.capacity(d, true, false).min(u - 1) {
                if self.pinned[x as usize - 1] {
                    break;
                }
                let ms = self.stage_ms(d, 0, x) + extra;
                for r in 0..self.flags {
                    self.offer(src, 0, r, dst, x, r | req, ms, d);
                }
            }
        }
        // The tail (never from 0: a chain of one device is not built here). On equal
        // cost the first offer stays: the tail holding least, the earlier stages
        // most, as the exhaustive search's fill has it (the deque below keeps the
        // latest y on ties for the same reason).
        let cap = p.capacity(d, false, true).min(u);
        if cap > 0 && !self.pinned[u as usize - 1] {
            for y in ((u - cap).max(1).max(self.run_start[u as usize - 1])..u).rev() {
                let ms = self.stage_ms(d, y, u) + extra;
                for r in 0..self.flags {
                    self.offer(src, y, r, dst, u, r | req, ms, d);
                }
            }
        }
        // Middle stages: best y in [x − cap, x − 1] of src[y] + w·(x − y), by a deque
        // of y with increasing src[y] − w·y.
        let cap = p.capacity(d, false, false);
        if cap == 0 {
            return;
        }
        let dev = p.devices[d];
        let w = f64::from(p.model.period) * dev.ms_per_layer;
        let fixed = dev.wake() + extra;
        let mut window: VecDeque<(u32, Cell)> = VecDeque::new();
        for r in 0..self.flags {
            window.clear();
            for x in 2..u {
                if self.pinned[x as usize - 1] {
                    window.clear();
                    continue;
                }
                let y = x - 1;
                let s = src[at(y, r)];
                if s.reached() {
                    let key = Cell { ms: s.ms - w * f64::from(y), ..s };
                    while window.back().is_some_and(|(_, k)| k.cmp_key(&key) != Ordering::Less) {
                        window.pop_back();
                    }
                    window.push_back((y, key));
                }
                while window.front().is_some_and(|&(y, _)| y.saturating_add(cap) < x) {
                    window.pop_front();
                }
                if let Some(&(y, _)) = window.front() {
                    let ms = w * f64::from(x - y) + fixed;
                    self.offer(src, y, r, dst, x, r | req, ms, d);
                }
            }
        }
    }

    /// One host's block after `input`: its devices in `order` (each used or not),
    /// adjacent; states with at least one of them used.
    fn run_block(&mut self, h: usize, order: &[usize], input: &[Cell]) -> Layer {
        let within = self.p.link_ms[h][h];
        let mut started = self.layer();
        let mut any = false;
        for &d in order {
            let mut next = started.clone();
            self.relax(input, 0.0, d, &mut next);
            if any {
                self.relax(&started, within, d, &mut next);
            }
            any = true;
            started = next;
        }
        started
    }

    /// Host `h`'s block after `input`, over the device orders that matter: which
    /// device is stage 0 (`first`: the block that starts the chain) and which is the
    /// tail; every order for a pinned host.
    fn block(&mut self, h: usize, first: bool, input: &[Cell]) -> Layer {
        let devs: Vec<usize> = self.p.host_devices[h].iter().copied().filter(|&d| self.c.allowed[d]).collect();
        let orders = if devs.len() <= EXACT_PINNED_DEVICES && devs.iter().any(|&d| self.pin_of[d].is_some()) {
            permutations(&devs)
        } else {
            let fronts: Vec<Option<usize>> = if first { devs.iter().copied().map(Some).collect() } else { vec![None] };
            let mut out: Vec<Vec<usize>> = Vec::new();
            for &f in &fronts {
                for t in std::iter::once(None).chain(devs.iter().copied().map(Some)) {
                    if t.is_some() && t == f {
                        continue;
                    }
                    let mut o: Vec<usize> = f.into_iter().collect();
                    o.extend(devs.iter().copied().filter(|&d| Some(d) != f && Some(d) != t));
                    o.extend(t);
                    if !out.contains(&o) {
                        out.push(o);
                    }
                }
            }
            out
        };
        // A GPU run beside its host's CPU never comes before it (llama.cpp's order).
        let orders = orders.into_iter().filter(|o| offload_last(self.p, o));
        let mut out = self.layer();
        for order in orders {
            let l = self.run_block(h, &order, input);
            for (o, c) in out.iter_mut().zip(l) {
                if c.beats(o) {
                    *o = c;
                }
            }
        }
        out
    }

    /// States of `from` entering host `h` (one more host, its link).
    fn enter(&self, from: &[Cell], link: f64, into: &mut [Cell]) {
        // Only states short of the end can take another block.
        for (i, s) in from.iter().enumerate().take(self.units as usize * 2) {
            if s.reached() {
                let cand = Cell { ms: s.ms + link, hosts: s.hosts + 1, ..*s };
                if cand.beats(&into[i]) {
                    into[i] = cand;
                }
            }
        }
    }

    /// Rebuild the chain of a finished state and offer it. The states' own sums
    /// order the chains within the DP; a finished chain is scored again by the
    /// model's one function ([`Problem::candidate`]), so every number a plan shows
    /// comes from one formula, whichever search found it.
    fn finish(&mut self, s: Cell) {
        let mut chain = Vec::new();
        let mut froms = Vec::new();
        let mut node = s.node;
        while node != NONE {
            let n = &self.arena[node as usize];
            chain.push(n.device as usize);
            froms.push(n.from);
            node = n.prev;
        }
        chain.reverse();
        froms.reverse();
        let mut bounds: Vec<u32> = froms.iter().map(|&f| self.p.unit_range(0, f).end).collect();
        bounds.push(self.p.model.layers);
        let cand = self.p.candidate(chain, bounds);
        self.consider(cand);
    }

    /// Exact over host orders: chains from host `hf` through any ordered subset of
    /// `hosts`, by the set of hosts visited and the last one.
    fn every_order_from(&mut self, hf: usize, hosts: &[usize]) {
        self.arena.clear();
        let others: Vec<usize> = hosts.iter().copied().filter(|&h| h != hf).collect();
        let m = others.len();
        let origin = self.origin();
        let first = self.block(hf, true, &origin);
        self.finish_best(&first, hf, hf);
        // by_set[mask][j]: chains over hf and the hosts in mask, ending on others[j].
        let mut by_set: Vec<Vec<Option<Layer>>> = vec![vec![None; m]; 1 << m];
        for mask in 1usize..(1 << m) {
            for j in 0..m {
                if mask & (1 << j) == 0 {
                    continue;
                }
                let prev = mask ^ (1 << j);
                let mut entry = self.layer();
                if prev == 0 {
                    self.enter(&first, self.p.link_ms[hf][others[j]], &mut entry);
                } else {
                    for (l, layer) in by_set[prev].iter().enumerate() {
                        if let Some(layer) = layer {
                            self.enter(layer, self.p.link_ms[others[l]][others[j]], &mut entry);
                        }
                    }
                }
                if entry.iter().any(Cell::reached) {
                    let l = self.block(others[j], false, &entry);
                    self.finish_best(&l, hf, others[j]);
                    by_set[mask][j] = Some(l);
                }
            }
        }
    }

    /// Chains whose hosts are a subsequence of `order` rotated to start anywhere.
    fn subsequences_of(&mut self, order: &[usize]) {
        for start in 0..order.len() {
            self.arena.clear();
            let seq: Vec<usize> = order[start..].iter().chain(&order[..start]).copied().collect();
            let hf = seq[0];
            let origin = self.origin();
            let mut last: Vec<Layer> = vec![self.block(hf, true, &origin)];
            self.finish_best(&last[0], hf, hf);
            for i in 1..seq.len() {
                let mut entry = self.layer();
                for (l, layer) in last.iter().enumerate() {
                    self.enter(layer, self.p.link_ms[seq[l]][seq[i]], &mut entry);
                }
                let l = if entry.iter().any(Cell::reached) { self.block(seq[i], false, &entry) } else { self.layer() };
                self.finish_best(&l, hf, seq[i]);
                last.push(l);
            }
        }
    }

    /// Offer the chain ending in `last` only if its state (with the closing link)
    /// is not worse than the best so far: rebuilding every ending would cost more
    /// than the DP.
    fn finish_best(&mut self, last: &[Cell], hf: usize, ht: usize) {
        let r = usize::from(self.c.required.is_some());
        let s = last[at(self.units, r)];
        if !s.reached() {
            return;
        }
        let closure = self.p.link_ms[ht][hf];
        if let Some(b) = &self.best {
            // A margin over the states' rounding; `consider` decides with the model.
            if s.ms + closure > b.decode_ms * (1.0 + 1e-9) + 1e-9 {
                return;
            }
        }
        self.finish(s);
    }
}

/// Every order of `items`.
/// Whether `order` (one host's devices) puts no [`crate::Device::offload`] device
/// before one that is not.
pub(crate) fn offload_last(p: &Problem<'_>, order: &[usize]) -> bool {
    order.windows(2).all(|w| !p.devices[w[0]].offload || p.devices[w[1]].offload)
}

fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let x = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

/// Cost of visiting `seq` in order, as a path (`closed`: back to the start too).
fn path_ms(p: &Problem<'_>, seq: &[usize], closed: bool) -> f64 {
    let mut ms: f64 = seq.windows(2).map(|w| p.link_ms[w[0]][w[1]]).sum();
    if closed && seq.len() > 1 {
        ms += p.link_ms[seq[seq.len() - 1]][seq[0]];
    }
    ms
}

/// 2-opt: reverse segments of `seq` (between fixed ends when `!closed`) while that
/// shortens it. Bounded: each pass that changes something shortens it.
fn two_opt(p: &Problem<'_>, seq: &mut [usize], closed: bool) {
    let n = seq.len();
    let (lo, hi) = if closed { (0, n) } else { (1, n.saturating_sub(1)) };
    for _ in 0..n * n {
        let mut improved = false;
        for i in lo..hi {
            for j in i + 1..hi {
                let before = path_ms(p, seq, closed);
                seq[i..=j].reverse();
                if path_ms(p, seq, closed) < before - 1e-12 {
                    improved = true;
                } else {
                    seq[i..=j].reverse();
                }
            }
        }
        if !improved {
            break;
        }
    }
}

/// A short cyclic tour of `hosts`: nearest neighbour from the first, then 2-opt.
fn tour(p: &Problem<'_>, hosts: &[usize]) -> Vec<usize> {
    let mut left: Vec<usize> = hosts.to_vec();
    let mut out = vec![left.remove(0)];
    while !left.is_empty() {
        let last = out[out.len() - 1];
        let (i, _) = left
            .iter()
            .enumerate()
            .min_by(|a, b| p.link_ms[last][*a.1].total_cmp(&p.link_ms[last][*b.1]))
            .expect("left is not empty");
        out.push(left.remove(i));
    }
    two_opt(p, &mut out, true);
    out
}

/// The cheapest order of `used` that keeps its first and last host (stage 0's and
/// the tail's, whose blocks hold the roles) in place: every order of up to 6 middle
/// hosts, 2-opt beyond.
fn cheapest_path(p: &Problem<'_>, used: &[usize]) -> Vec<usize> {
    if used.len() <= 3 {
        return used.to_vec();
    }
    let (head, tail) = (used[0], used[used.len() - 1]);
    let middle = &used[1..used.len() - 1];
    let mut best = used.to_vec();
    if middle.len() <= 6 {
        let mut best_ms = path_ms(p, used, false);
        for perm in permutations(middle) {
            let mut seq = vec![head];
            seq.extend(perm);
            seq.push(tail);
            let ms = path_ms(p, &seq, false);
            if ms < best_ms - 1e-12 {
                best_ms = ms;
                best = seq;
            }
        }
    } else {
        two_opt(p, &mut best, false);
    }
    best
}
