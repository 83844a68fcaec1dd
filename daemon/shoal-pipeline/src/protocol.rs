//! The control protocol (ALPN `shoal/control/1`): a client opens a bidirectional
//! stream to the coordinator, sends one JSON [`GenerateRequest`], and reads
//! newline-delimited JSON [`GenEvent`]s until `done` or `error`.

use crate::placement::StagePlace;
use crate::PipelineError;
use serde::{Deserialize, Serialize};
use shoal_net::{alpn, Node};
use shoal_types::{SamplingParams, SpecSettings, TokenId};

/// Largest request accepted (a prompt of ~250k tokens).
pub const MAX_REQUEST: usize = 1 << 20;

/// Ask the coordinator for a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids (the client tokenizes: every node holds the model's vocabulary).
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate.
    pub max_new: u32,
    /// Generation stops after any of these (end-of-generation tokens); may be empty.
    pub stop: Vec<TokenId>,
    /// Sampling parameters ([`SamplingParams`] as a JSON object), checked by the
    /// coordinator and again by the tail, then handed to the tail's sampler factory.
    pub sampling: serde_json::Value,
    /// Tokens this generation already produced (on a placement that is gone): the
    /// coordinator replays them in their original shapes, one per step after the
    /// prompt's chunks, checks that they come out again, and streams only what follows.
    /// The answer is then the one an uninterrupted run gives (DESIGN point 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume: Vec<TokenId>,
    /// Speculative decoding: each decode step verifies what prompt lookup drafts
    /// (`shoal_types::speculative`). `None` or `max_draft` 0: one token per step. Off for
    /// requests that ask for log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecSettings>,
    /// A number the client picks for the generation and sends again when it resumes
    /// it: the coordinator ends a generation with the same tag from the same node that
    /// still runs before it admits the resumption. A client that lost its connection
    /// (the coordinator's address changed, or a link was out past the idle timeout)
    /// resumes at once, while the coordinator may learn that the old stream is dead
    /// only at QUIC's idle timeout; meanwhile the old generation would hold a session
    /// and keep the resumption waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<u64>,
}

impl GenerateRequest {
    /// Whether a generation that has made `made` is over: all `max_new` made, or the
    /// last one is an end-of-generation token. A fault between its last token and its
    /// report leaves nothing to resume (and resuming would make tokens past its end).
    pub fn finished_by(&self, made: &[TokenId]) -> bool {
        made.len() >= self.max_new as usize || made.last().is_some_and(|t| self.stop.contains(t))
    }

    /// Refuse a request that cannot run within a context of `n_ctx` positions, or whose
    /// sampling parameters are malformed or out of bounds, with a message for the
    /// client. The coordinator calls this before anything reaches a stage.
    pub fn validate(&self, n_ctx: u32) -> Result<SamplingParams, String> {
        let params = sampling_params(&self.sampling).map_err(|e| format!("bad sampling parameters: {e}"))?;
        shoal_types::validate_generation(&params, self.prompt.len(), self.max_new, n_ctx).map_err(|e| e.to_string())?;
        if self.resume.len() >= self.max_new as usize {
            return Err(format!(
                "a resumed generation must have tokens left to make: {} of max {} made",
                self.resume.len(),
                self.max_new
            ));
        }
        if let Some(spec) = &self.speculative {
            spec.validate().map_err(|e| e.to_string())?;
        }
        if self.resume.iter().any(|t| self.stop.contains(t)) {
            return Err("a resumed generation cannot hold a stop token: it would have ended there".into());
        }
        Ok(params)
    }
}

/// Parse and check sampling parameters as they arrive from the network (the tail gets
/// them in the session's Open frame): malformed or out-of-bounds ones are refused before
/// a sampler is made.
pub fn sampling_params(value: &serde_json::Value) -> Result<SamplingParams, String> {
    let params = SamplingParams::deserialize(value).map_err(|e| e.to_string())?;
    params.validate().map_err(|e| e.to_string())?;
    Ok(params)
}

/// What a finished generation reports.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// Generated tokens.
    pub tokens: Vec<TokenId>,
    /// BLAKE3 over the tail's logits of every sampled step (as `shoal run` prints it).
    pub logits_digest: String,
    /// Request to first token.
    pub prefill_s: f64,
    /// First token to last.
    pub decode_s: f64,
    /// Tokens after the first per second of decode.
    pub tok_per_s: f64,
    /// Decode steps taken (passes through the stages after the prompt's).
    #[serde(default)]
    pub decode_steps: u64,
    /// Tokens drafted by speculation, and how many of them were accepted.
    #[serde(default)]
    pub drafted: u64,
    #[serde(default)]
    pub accepted: u64,
}

/// A request on the control protocol.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlRequest {
    /// Run a generation (the coordinator only).
    Generate(GenerateRequest),
    /// Report this node's state (any node).
    Status,
    /// "I have just started": sent by a stage to the stage before it (whose link to it
    /// may still be a connection to its previous life, retransmitting into the void
    /// with QUIC's growing probe timeouts) and to the coordinator (which re-drives its
    /// generations at once). Honoured only from a node of the ring; answered with an
    /// empty stream.
    Started,
}

/// A node's state, for `shoal status` (and the admin page and `/metrics` later).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeStatus {
    /// The node's id.
    pub node: String,
    /// Its stage.
    pub layers: shoal_types::LayerRange,
    /// Sessions it holds now.
    pub sessions: usize,
    /// Generations waiting for a session (the coordinator's queue).
    #[serde(default)]
    pub waiting: usize,
    /// Protocol counters.
    pub counters: crate::core::Counters,
    /// Times the link to the next node was (re)established.
    pub link_connects: u64,
    /// Frames refused by the decoder (malformed).
    pub malformed_frames: u64,
    /// Refusals the next stage sent back about this node's frames.
    pub refused_by_next: u64,
    /// Whether the stage before this one and the coordinator have taken in this
    /// stage's start (always true at the coordinator). While false they may still be
    /// sending to its previous life, or it cannot reach them.
    #[serde(default)]
    pub start_announced: bool,
    /// Latency of the frames received from the previous stage, by size class.
    #[serde(default)]
    pub hop_in: Vec<crate::latency::HopLatency>,
    /// Decode steps (one token) this node's stage computed.
    #[serde(default)]
    pub decode_steps: u64,
    /// Their mean compute time, ms (the tail's includes the LM head).
    #[serde(default)]
    pub decode_compute_ms: f64,
    /// Mean time a decode step spends handing over to the stage thread and back, ms.
    #[serde(default)]
    pub decode_handoff_ms: f64,
    /// Control clients disconnected because they did not read their events (their
    /// generations were cancelled; see `Counters::cancelled`).
    #[serde(default)]
    pub slow_clients_dropped: u64,
    /// Whether keep-alive is on (the node spins between tokens while generating).
    #[serde(default)]
    pub keepalive: bool,
    /// Whether it spins right now (a session generated within the keep-alive window).
    #[serde(default)]
    pub keepalive_spinning: bool,
    /// This node's share of its decode steps' time (see [`crate::TokenBreakdown`]).
    #[serde(default)]
    pub decode_times: crate::breakdown::DecodeTimes,
}

impl NodeStatus {
    /// What one decode step's compute takes on this stage, ms (the mean over the steps
    /// so far; the tail's includes the LM head); `None` before its first step. The
    /// admin page shows it per stage and adds the stages' up.
    pub fn compute_ms_per_step(&self) -> Option<f64> {
        (self.decode_steps > 0 && self.decode_compute_ms.is_finite()).then_some(self.decode_compute_ms)
    }
}

/// One line of the coordinator's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum GenEvent {
    /// A token was generated.
    Token(TokenId),
    /// A token was generated, with the log-probabilities the request asked for.
    Scored(TokenId, shoal_types::TokenLogprobs),
    /// The generation finished.
    Done(Report),
    /// The generation failed.
    Error(String),
    /// Every session runs and the queue is full: try again later.
    Busy(String),
}

impl GenEvent {
    /// Whether more events follow this one (a token's).
    pub fn is_token(&self) -> bool {
        matches!(self, GenEvent::Token(_) | GenEvent::Scored(..))
    }
}

/// Run a generation on the pipeline whose coordinator is `coordinator`, calling
/// `on_token` for each token as it arrives (with its log-probabilities when the
/// request's sampling asked for them).
pub async fn generate(
    node: &Node,
    coordinator: &StagePlace,
    request: &GenerateRequest,
    mut on_token: impl FnMut(TokenId, Option<shoal_types::TokenLogprobs>),
) -> Result<Report, PipelineError> {
    let stream_err = |e: &dyn std::fmt::Display| PipelineError::Stream(e.to_string());
    let conn = node.connect(coordinator.addr, coordinator.node, alpn::CONTROL).await?;
    let (mut send, recv) = conn.open_bi().await.map_err(|e| stream_err(&e))?;
    // Invariant: a request of plain numbers and a JSON value always serialises.
    let body = serde_json::to_vec(&ControlRequest::Generate(request.clone())).expect("request serialises");
    send.write_all(&body).await.map_err(|e| stream_err(&e))?;
    send.finish().map_err(|e| stream_err(&e))?;
    let mut lines = tokio::io::BufReader::new(recv);
    let mut line = String::new();
    loop {
        line.clear();
        let n = tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line).await.map_err(|e| stream_err(&e))?;
        if n == 0 {
            // The coordinator went away (it stopped, or restarted): the stream failed,
            // the generation did not (a client may resume it).
            return Err(PipelineError::Stream("the coordinator closed the stream without a result".into()));
        }
        match serde_json::from_str::<GenEvent>(&line) {
            Ok(GenEvent::Token(t)) => on_token(t, None),
            Ok(GenEvent::Scored(t, lp)) => on_token(t, Some(lp)),
            Ok(GenEvent::Done(report)) => {
                conn.close(0u32.into(), b"done");
                return Ok(report);
            }
            Ok(GenEvent::Error(message)) => return Err(PipelineError::Generation(message)),
            Ok(GenEvent::Busy(message)) => return Err(PipelineError::Busy(message)),
            Err(e) => return Err(PipelineError::Generation(format!("bad answer from the coordinator: {e}"))),
        }
    }
}

/// Tell the node at `place` that this node has just started (see
/// [`ControlRequest::Started`]); returns once it has taken the news in (its event loop
/// has it queued, ahead of any frame that comes after).
pub async fn announce_started(node: &Node, place: &StagePlace) -> Result<(), PipelineError> {
    ask(node, place, &ControlRequest::Started, 0).await.map(drop)
}

/// Ask the node at `place` for its state.
pub async fn status(node: &Node, place: &StagePlace) -> Result<NodeStatus, PipelineError> {
    let body = ask(node, place, &ControlRequest::Status, 1 << 20).await?;
    serde_json::from_slice(&body).map_err(|e| PipelineError::Generation(format!("bad status answer: {e}")))
}

/// One control request that answers with a single body (at most `limit` bytes) on a
/// connection of its own.
async fn ask(
    node: &Node,
    place: &StagePlace,
    request: &ControlRequest,
    limit: usize,
) -> Result<Vec<u8>, PipelineError> {
    let stream_err = |e: &dyn std::fmt::Display| PipelineError::Stream(e.to_string());
    let conn = node.connect(place.addr, place.node, alpn::CONTROL).await?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| stream_err(&e))?;
    // Invariant: a request of plain numbers and JSON values always serialises.
    send.write_all(&serde_json::to_vec(request).expect("request serialises")).await.map_err(|e| stream_err(&e))?;
    send.finish().map_err(|e| stream_err(&e))?;
    let body = recv.read_to_end(limit).await.map_err(|e| stream_err(&e))?;
    conn.close(0u32.into(), b"done");
    Ok(body)
}
