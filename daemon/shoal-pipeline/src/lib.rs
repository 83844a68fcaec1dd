//! The pipeline across processes and hosts: each node hosts a stage of a placement;
//! hidden states flow stage to stage over QUIC (`shoal-net`), the tail samples and
//! sends each token straight back to the coordinator (the node of stage 0), which
//! drives generations on the canonical schedule (prompt in chunks of C, then one token
//! per step). Logits never cross the network. Engines are injected as `dyn Stage`, so
//! this crate builds and tests without llama.cpp.
//!
//! The protocol logic lives in [`core`] (pure, simulated in tests); `service` is the
//! async shell around it.

pub mod breakdown;
pub mod core;
pub mod latency;
pub mod placement;
pub mod protocol;
pub mod service;

pub use breakdown::{DecodeTimes, Timing, TokenBreakdown};
pub use core::{Counters, RetryPolicy};
pub use latency::{HopLatencies, HopLatency};
pub use placement::{Placement, PlacementError, StagePlace};
pub use protocol::{generate, status, ControlRequest, GenEvent, GenerateRequest, NodeStatus, Report};
pub use service::{serve, serve_on, SamplerFactory, ServiceConfig, KEEPALIVE_WINDOW, QUEUE_PER_SESSION};

/// Errors of the pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The network failed.
    #[error(transparent)]
    Net(#[from] shoal_net::NetError),
    /// A QUIC stream failed.
    #[error("stream: {0}")]
    Stream(String),
    /// The coordinator refused or failed the generation.
    #[error("generation failed: {0}")]
    Generation(String),
    /// The coordinator runs every session and its queue is full.
    #[error("{0}")]
    Busy(String),
    /// This node has no stage in the placement.
    #[error("node {0} has no stage in the placement")]
    NotPlaced(String),
}
