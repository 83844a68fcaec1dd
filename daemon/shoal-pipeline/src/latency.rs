//! Per-hop frame latency: how long a frame spends between leaving the sender's
//! protocol core and reaching the receiver's (queues, QUIC, the wire; no compute).
//! Frames carry the sender's wall clock ([`Frame::sent_us`]); the receiver records
//! the difference in histograms by frame size, for `shoal status` and the benches.

use serde::{Deserialize, Serialize};
use shoal_net::{Frame, FrameKind};

/// Size classes, so decode frames (one token, a few KB) are not averaged with
/// prefill chunks (hundreds of KB).
const CLASSES: [&str; 4] = ["token ids", "hidden <= 4 KiB", "hidden 4-64 KiB", "hidden > 64 KiB"];

/// Latency histograms of the frames one node received from the previous stage.
pub struct HopLatencies {
    /// One histogram (µs) per entry of `CLASSES`.
    histograms: Vec<hdrhistogram::Histogram<u64>>,
    /// Payload bytes per class, for the mean frame size.
    bytes: [u64; 4],
    /// Frames that carried no usable stamp (unstamped, or a sender clock ahead of ours).
    unstamped: u64,
}

/// A summary of one size class.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HopLatency {
    /// Which frames ("hidden <= 4 KiB", …).
    pub class: String,
    /// Frames recorded.
    pub frames: u64,
    /// Mean payload size.
    pub mean_bytes: u64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// Largest seen, µs.
    pub max_us: u64,
}

impl Default for HopLatencies {
    fn default() -> Self {
        // Invariant: the bounds are constants that hdrhistogram accepts (1 µs to 10 min, 2 digits).
        let h = || hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 2).expect("valid histogram bounds");
        Self { histograms: (0..CLASSES.len()).map(|_| h()).collect(), bytes: [0; 4], unstamped: 0 }
    }
}

impl HopLatencies {
    /// Record `f` as it reaches this node's core.
    pub fn record(&mut self, f: &Frame) {
        let class = match f.kind {
            FrameKind::Token => 0,
            FrameKind::Hidden if f.payload.len() <= 4 << 10 => 1,
            FrameKind::Hidden if f.payload.len() <= 64 << 10 => 2,
            FrameKind::Hidden => 3,
            _ => return,
        };
        let Some(age) = f.age_us() else {
            self.unstamped += 1;
            return;
        };
        self.histograms[class].saturating_record(u64::from(age).max(1));
        self.bytes[class] += f.payload.len() as u64;
    }

    /// The classes that saw frames.
    pub fn summary(&self) -> Vec<HopLatency> {
        CLASSES
            .iter()
            .zip(&self.histograms)
            .zip(self.bytes)
            .filter(|((_, h), _)| !h.is_empty())
            .map(|((class, h), bytes)| HopLatency {
                class: class.to_string(),
                frames: h.len(),
                mean_bytes: bytes / h.len(),
                p50_us: h.value_at_quantile(0.5),
                p99_us: h.value_at_quantile(0.99),
                max_us: h.max(),
            })
            .collect()
    }

    /// Frames without a usable stamp.
    pub fn unstamped(&self) -> u64 {
        self.unstamped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_net::{wall_us, Dtype};

    fn aged(values: usize, age_us: u32) -> Frame {
        let mut f = Frame::hidden(1, 0, 0, 0, &vec![0.0; values], 1, Dtype::F32);
        f.sent_us = wall_us().wrapping_sub(age_us);
        f
    }

    #[test]
    fn frames_are_binned_by_size_and_summarised() {
        let mut h = HopLatencies::default();
        for _ in 0..98 {
            h.record(&aged(576, 80));
        }
        h.record(&aged(576, 5_000));
        h.record(&aged(576, 9_000));
        h.record(&aged(8064, 150)); // 14 tokens of 576 floats: 32 KB
        h.record(&Frame::hidden(1, 0, 0, 0, &[0.0; 4], 1, Dtype::F32)); // unstamped
        let s = h.summary();
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!((s[0].class.as_str(), s[0].frames, s[0].mean_bytes), ("hidden <= 4 KiB", 100, 2304));
        // Ages are at least what was stamped, and a run takes far less than 10 ms.
        assert!((80..200).contains(&s[0].p50_us), "{s:?}");
        assert!(s[0].p99_us >= 5_000 && s[0].max_us >= 9_000, "{s:?}");
        assert_eq!((s[1].class.as_str(), s[1].frames, s[1].mean_bytes), ("hidden 4-64 KiB", 1, 32256));
        assert_eq!(h.unstamped(), 1);
    }
}
