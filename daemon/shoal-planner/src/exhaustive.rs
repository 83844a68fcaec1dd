//! The exhaustive search the planner used before [`crate::search`]: every ordered
//! chain of devices (one host's devices adjacent), each filled greedily. Its cost
//! grows factorially with the devices, so it only serves as the oracle the scalable
//! search is tested against ([`crate::plan::plan_exhaustive`],
//! [`crate::plan::considered`]).

use crate::plan::{Candidate, Problem};

impl Problem<'_> {
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
                // An offloading GPU comes after its host's other devices.
                if last_host == Some(host)
                    && chain.last().is_some_and(|&l| p.devices[l].offload)
                    && !p.devices[d].offload
                {
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

    /// Every chain that can be filled, filled, with its prediction.
    pub(crate) fn candidates(&self, pins: &[(usize, u32, u32)]) -> Vec<Candidate> {
        let mut out = Vec::new();
        for chain in self.chains() {
            if let Some(bounds) = self.fill(&chain, pins) {
                out.push(self.candidate(chain, bounds));
            }
        }
        out
    }
}
