//! Where a decode step's time goes: each node times its share of every step (compute,
//! the stage thread's hand-off, the protocol core, its queues and the QUIC write), the
//! receiver times each hop, the coordinator times the step interval; [`TokenBreakdown`]
//! adds the nodes' shares up round the ring and names what is left unexplained.
//!
//! "Step" is one pass of the ring: one token, or one verify step of 1 + k positions
//! with speculative decoding. Prefill chunks are not counted.

use crate::protocol::NodeStatus;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The samples of one quantity, shared between the tasks and threads that time it.
pub(crate) struct Mean {
    /// Nanoseconds, 2 significant digits (a lock held for one record).
    histogram: std::sync::Mutex<hdrhistogram::Histogram<u64>>,
}

impl Default for Mean {
    fn default() -> Self {
        // Invariant: the bounds are constants that hdrhistogram accepts (1 ns to 10 min, 2 digits).
        let h = hdrhistogram::Histogram::new_with_bounds(1, 600_000_000_000, 2).expect("valid histogram bounds");
        Mean { histogram: std::sync::Mutex::new(h) }
    }
}

impl Mean {
    /// Count one sample.
    pub(crate) fn add(&self, d: Duration) {
        if let Ok(mut h) = self.histogram.lock() {
            h.saturating_record((d.as_nanos() as u64).max(1));
        }
    }

    /// The samples so far.
    pub(crate) fn timing(&self) -> Timing {
        match self.histogram.lock() {
            Ok(h) if !h.is_empty() => {
                Timing { n: h.len(), mean_us: h.mean() / 1e3, p50_us: h.value_at_quantile(0.5) as f64 / 1e3 }
            }
            _ => Timing::default(),
        }
    }
}

/// Samples of one part of a step.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Timing {
    /// Samples.
    pub n: u64,
    /// Their mean, µs (0 without samples): means add up round the ring.
    pub mean_us: f64,
    /// Their median, µs: the typical step, without the few a busy machine delayed.
    #[serde(default)]
    pub p50_us: f64,
}

/// One node's share of its decode steps' time, as it measured it (means per step).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DecodeTimes {
    /// The stage's forward pass (the tail's includes the LM head).
    pub compute: Timing,
    /// The forward pass's time on a core (its thread's CPU time; `n` 0 where the
    /// platform has no per-thread clock). `compute` less this is the time its thread
    /// was off the CPU: with one CPU thread per stage, the time its core ran other
    /// threads (where the stages share a machine: the nodes' networking and the other
    /// stages); with more threads it also holds waits for its thread pool, and with GPU
    /// layers the wait for the GPU.
    #[serde(default)]
    pub compute_cpu: Timing,
    /// Handing the step to the stage thread and its result back (0 when it ran inline
    /// on the event loop's thread).
    pub handoff: Timing,
    /// The protocol core handling the step's frame as it arrives (the coordinator's
    /// includes emitting the token, drafting and making the next step).
    pub core_in: Timing,
    /// The protocol core handling the stage's result (the tail's is sampling; others
    /// build the frame for the next stage).
    pub core_out: Timing,
    /// From the reader task decoding a step's frame to the event loop taking it (the
    /// event loop's wake-up and queue).
    pub receive_wait: Timing,
    /// From the sender's core to this node's core (the sender's clock stamp): the whole
    /// hop, both nodes' queues included.
    pub hop_in: Timing,
    /// From the core emitting a frame to the link task taking it (its wake-up).
    pub send_wait: Timing,
    /// Encoding the frame and writing it into the QUIC stream.
    pub write: Timing,
    /// Coordinator: from one step of a session to its next (the time a step takes,
    /// seen from the ring's start; one stream at a time gives the clean figure).
    pub interval: Timing,
    /// Coordinator: writing a token event into its control client's stream (beside
    /// the ring: the next step is already on its way).
    pub client_write: Timing,
}

/// One line of a [`TokenBreakdown`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// What it is ("stage 0 compute", "hop 0→1 wire and QUIC", …).
    pub what: String,
    /// Mean µs per step.
    pub us: f64,
    /// Median µs.
    pub p50_us: f64,
}

/// A decode step's time at the coordinator, split into the parts the nodes measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenBreakdown {
    /// Steps the coordinator timed.
    pub steps: u64,
    /// Mean step interval, µs.
    pub interval_us: f64,
    /// Median step interval, µs.
    pub interval_p50_us: f64,
    /// The parts round the ring, in order.
    pub parts: Vec<Part>,
    /// What no part explains: `interval_us` minus the parts (wake-ups and queues no
    /// node timed; can be slightly negative from rounding of means).
    pub unexplained_us: f64,
    /// Writing tokens to the client, beside the ring (not part of the interval).
    pub client_us: f64,
}

impl TokenBreakdown {
    /// Add up `ring`'s shares: its nodes' statuses in pipeline order (the coordinator
    /// first). `None` when the coordinator timed no step yet.
    pub fn of(ring: &[NodeStatus]) -> Option<TokenBreakdown> {
        let coordinator = ring.first()?;
        let interval = coordinator.decode_times.interval;
        if interval.n == 0 {
            return None;
        }
        let n = ring.len();
        let mut parts = Vec::new();
        let mut part = |what: String, t: Timing| parts.push(Part { what, us: t.mean_us, p50_us: t.p50_us });
        for (i, st) in ring.iter().enumerate() {
            let d = &st.decode_times;
            let next = &ring[(i + 1) % n].decode_times;
            let tail = i + 1 == n;
            part(format!("stage {i} protocol core, frame in"), d.core_in);
            part(format!("stage {i} hand-off to the stage thread"), d.handoff);
            if d.compute_cpu.n > 0 {
                // The compute split in its thread's time on and off the CPU (both sum
                // to the compute's wall time; the median off the CPU is the medians'
                // difference, not the median of each step's, a close enough figure).
                let off = |wall: f64, cpu: f64| (wall - cpu).max(0.0);
                let cpu = Timing {
                    n: d.compute.n,
                    mean_us: d.compute_cpu.mean_us.min(d.compute.mean_us),
                    p50_us: d.compute_cpu.p50_us.min(d.compute.p50_us),
                };
                part(format!("stage {i} compute ({})", st.layers), cpu);
                part(
                    format!("stage {i} compute, its thread off the CPU"),
                    Timing {
                        n: d.compute.n,
                        mean_us: off(d.compute.mean_us, d.compute_cpu.mean_us),
                        p50_us: off(d.compute.p50_us, d.compute_cpu.p50_us),
                    },
                );
            } else {
                part(format!("stage {i} compute ({})", st.layers), d.compute);
            }
            part(format!("stage {i} {}", if tail { "sampling" } else { "protocol core, result out" }), d.core_out);
            if n == 1 {
                continue;
            }
            let hop = format!("hop {i}→{}", (i + 1) % n);
            // The receiver's hop time covers the sender's queue and write and its own
            // receive queue; what remains is QUIC and the wire.
            let queues = d.send_wait.mean_us + d.write.mean_us + next.receive_wait.mean_us;
            part(format!("{hop} link task wake-up"), d.send_wait);
            part(format!("{hop} QUIC stream write"), d.write);
            let p50_queues = d.send_wait.p50_us + d.write.p50_us + next.receive_wait.p50_us;
            let wire = Timing {
                n: next.hop_in.n,
                mean_us: (next.hop_in.mean_us - queues).max(0.0),
                p50_us: (next.hop_in.p50_us - p50_queues).max(0.0),
            };
            part(format!("{hop} QUIC and wire"), wire);
            part(format!("{hop} receiver's event-loop wake-up"), next.receive_wait);
        }
        let explained: f64 = parts.iter().map(|p| p.us).sum();
        Some(TokenBreakdown {
            steps: interval.n,
            interval_us: interval.mean_us,
            interval_p50_us: interval.p50_us,
            unexplained_us: interval.mean_us - explained,
            parts,
            client_us: coordinator.decode_times.client_write.mean_us,
        })
    }

    /// The breakdown as a table, one line per part: its mean, its share of the mean
    /// interval, and its median.
    pub fn lines(&self) -> Vec<String> {
        let share = |us: f64| 100.0 * us / self.interval_us.max(1e-9);
        let mut out = vec![
            format!("where a decode step's time goes ({} steps timed at the coordinator; µs):", self.steps),
            format!("  {:<52} {:>9} {:>7} {:>9}", "", "mean", "share", "median"),
            format!(
                "  {:<52} {:>9.1} {:>6.1}% {:>9.1}",
                "step interval at the coordinator", self.interval_us, 100.0, self.interval_p50_us
            ),
        ];
        for p in &self.parts {
            out.push(format!("  {:<52} {:>9.1} {:>6.1}% {:>9.1}", p.what, p.us, share(p.us), p.p50_us));
        }
        out.push(format!(
            "  {:<52} {:>9.1} {:>6.1}%",
            "not timed by any node (wake-ups, queues)",
            self.unexplained_us,
            share(self.unexplained_us)
        ));
        out.push(format!("  {:<52} {:>9.1}", "beside the ring: writing a token to the client", self.client_us));
        out
    }

    /// Compute's share of the step, its wall time (the rest is protocol, queues and
    /// the wire).
    pub fn compute_us(&self) -> f64 {
        self.parts
            .iter()
            .filter(|p| p.what.contains(" compute (") || p.what.contains(" compute, its thread off"))
            .map(|p| p.us)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(mean_us: f64) -> Timing {
        Timing { n: 10, mean_us, p50_us: mean_us / 2.0 }
    }

    fn node(d: DecodeTimes) -> NodeStatus {
        NodeStatus {
            node: "n".into(),
            layers: shoal_types::LayerRange { start: 0, end: 15 },
            sessions: 0,
            waiting: 0,
            counters: Default::default(),
            link_connects: 0,
            malformed_frames: 0,
            refused_by_next: 0,
            start_announced: true,
            hop_in: Vec::new(),
            decode_steps: 0,
            decode_compute_ms: 0.0,
            decode_handoff_ms: 0.0,
            slow_clients_dropped: 0,
            keepalive: false,
            keepalive_spinning: false,
            decode_times: d,
        }
    }

    #[test]
    fn the_ring_adds_up_and_the_rest_is_unexplained() {
        let head = DecodeTimes {
            compute: t(5000.0),
            core_in: t(20.0),
            core_out: t(10.0),
            send_wait: t(5.0),
            write: t(15.0),
            receive_wait: t(8.0),
            hop_in: t(100.0),
            interval: t(11_000.0),
            client_write: t(12.0),
            ..Default::default()
        };
        let tail = DecodeTimes {
            compute: t(5500.0),
            handoff: t(30.0),
            core_in: t(5.0),
            core_out: t(40.0),
            send_wait: t(4.0),
            write: t(6.0),
            receive_wait: t(7.0),
            hop_in: t(120.0),
            ..Default::default()
        };
        let b = TokenBreakdown::of(&[node(head), node(tail)]).unwrap();
        assert_eq!((b.steps, b.interval_us), (10, 11_000.0));
        let us = |what: &str| b.parts.iter().find(|p| p.what.starts_with(what)).unwrap().us;
        // Hop 0→1: the tail saw 120 µs; the head's queue and write (5 + 15) and the
        // tail's receive queue (7) are not the wire.
        assert_eq!(us("hop 0→1 QUIC and wire"), 120.0 - 27.0);
        // Hop 1→0: 100 µs at the head, less 4 + 6 + 8.
        assert_eq!(us("hop 1→0 QUIC and wire"), 100.0 - 18.0);
        assert_eq!(us("stage 1 sampling"), 40.0);
        assert_eq!(b.compute_us(), 10_500.0);
        let explained = 20.0 + 5000.0 + 10.0 + 220.0 + 5.0 + 30.0 + 5500.0 + 40.0;
        assert!((b.unexplained_us - (11_000.0 - explained)).abs() < 1e-9, "{b:?}");
        assert_eq!(b.client_us, 12.0);
        let lines = b.lines();
        assert_eq!(lines.len(), 3 + b.parts.len() + 2, "{lines:#?}");
        assert!(
            lines[2].contains("11000.0") && lines[2].contains("100.0%") && lines[2].contains("5500.0"),
            "{lines:#?}"
        );
        // Medians are split the same way: 60 µs at the tail less 2.5 + 7.5 + 3.5.
        let wire = b.parts.iter().find(|p| p.what.starts_with("hop 0→1 QUIC and wire")).unwrap();
        assert_eq!(wire.p50_us, 60.0 - 13.5);
    }

    #[test]
    fn a_compute_splits_in_its_threads_time_on_and_off_the_cpu() {
        let coordinator =
            DecodeTimes { compute: t(5000.0), compute_cpu: t(3800.0), interval: t(6000.0), ..Default::default() };
        let b = TokenBreakdown::of(&[node(coordinator)]).unwrap();
        let part = |what: &str| b.parts.iter().find(|p| p.what.starts_with(what)).unwrap().clone();
        assert_eq!(part("stage 0 compute (").us, 3800.0);
        let taken = part("stage 0 compute, its thread off the CPU");
        assert_eq!((taken.us, taken.p50_us), (1200.0, 600.0));
        // Compute is still its whole wall time, and the parts still add up.
        assert_eq!(b.compute_us(), 5000.0);
        assert!((b.unexplained_us - 1000.0).abs() < 1e-9, "{b:?}");
        // A CPU time above the wall time (clock granularity) is no negative share.
        let odd = DecodeTimes { compute: t(100.0), compute_cpu: t(120.0), interval: t(200.0), ..Default::default() };
        let b = TokenBreakdown::of(&[node(odd)]).unwrap();
        assert_eq!(b.compute_us(), 100.0);
    }

    #[test]
    fn no_breakdown_before_the_coordinator_timed_a_step() {
        assert!(TokenBreakdown::of(&[]).is_none());
        assert!(TokenBreakdown::of(&[node(DecodeTimes::default())]).is_none());
    }
}
