//! The stage service: one per node. An actor owns the node's sessions and runs a
//! `select!`-free event loop over one channel fed by the links, the control streams
//! and the stage worker; the stage itself computes on its own thread so the network
//! keeps flowing while it works (prefill chunks overlap across stages).

use crate::placement::Placement;
use crate::protocol::{GenEvent, GenerateRequest, Report, MAX_REQUEST};
use crate::PipelineError;
use shoal_net::frame::{FLAG_SAMPLE, HEADER_LEN};
use shoal_net::{alpn, Dtype, Frame, FrameKind, FrameLimits, Node, NodeId};
use shoal_types::{SessionId, Stage, StageError, StageInput, StageOutput, TokenId, TokenSampler};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Makes the tail's sampler for a session from the request's sampling parameters.
pub type SamplerFactory = Arc<dyn Fn(&serde_json::Value) -> Result<Box<dyn TokenSampler>, String> + Send + Sync>;

/// What a node needs to serve its stage.
pub struct ServiceConfig {
    /// The placement every node shares.
    pub placement: Placement,
    /// This node's stage in it.
    pub index: usize,
    /// The loaded stage.
    pub stage: Box<dyn Stage>,
    /// Sampler factory (used when this node is the tail).
    pub samplers: SamplerFactory,
    /// Element type of hidden states on the wire (F32: exact).
    pub dtype: Dtype,
}

/// Largest Open/Close/Error payload.
const MAX_MESSAGE: u32 = 64 << 10;

/// Work for the stage thread.
enum Work {
    Forward(Job),
    Free(u64),
}

/// One forward step and where its result goes.
struct Job {
    session: u64,
    epoch: u32,
    step: u32,
    first_pos: u32,
    flags: u8,
    input: Input,
}

enum Input {
    Tokens(Vec<TokenId>),
    Hidden(Vec<f32>),
}

/// Everything the actor reacts to.
enum Event {
    /// A frame from the previous stage (or, for the coordinator, from the tail).
    Frame(Frame),
    /// The stage thread finished a job.
    Done(Job, Result<StageOutput, StageError>),
    /// A client asks for a generation (coordinator only).
    Generate(GenerateRequest, mpsc::Sender<GenEvent>),
}

/// Per-session state on this node.
struct Session {
    /// Frames of another epoch are stale.
    epoch: u32,
    /// Tail: the session's sampler and running digest of the sampled steps' logits.
    tail: Option<(Box<dyn TokenSampler>, blake3::Hasher)>,
    /// Coordinator: the generation it drives.
    driver: Option<Driver>,
}

/// The coordinator's view of a generation.
struct Driver {
    events: mpsc::Sender<GenEvent>,
    max_new: usize,
    stop: Vec<TokenId>,
    tokens: Vec<TokenId>,
    /// Position the next token goes to.
    pos: u32,
    /// The step whose token we wait for; tokens of other steps are duplicates.
    awaiting: u32,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// Serve `cfg`'s stage on `node` until the endpoint closes.
pub async fn serve(node: Arc<Node>, cfg: ServiceConfig) -> Result<(), PipelineError> {
    let ServiceConfig { placement, index, stage, samplers, dtype } = cfg;
    let info = stage.info().clone();
    let limits = FrameLimits { n_embd: info.n_embd, max_tokens: info.chunk, max_message: MAX_MESSAGE };
    let (events_tx, mut events) = mpsc::channel::<Event>(1024);

    // The stage thread.
    let (work_tx, work_rx) = std::sync::mpsc::channel::<Work>();
    let done_tx = events_tx.clone();
    std::thread::Builder::new()
        .name(format!("stage-{}", info.layers))
        .spawn(move || stage_thread(stage, work_rx, done_tx))
        .map_err(|e| PipelineError::Stream(format!("cannot start the stage thread: {e}")))?;

    // The link to the next node (the coordinator, after the tail).
    let next = placement.next(index).clone();
    let next_is_self = next.node == node.id();
    let (link_tx, link_rx) = mpsc::channel::<Frame>(1024);
    if !next_is_self {
        tokio::spawn(link_task(node.clone(), next.addr, next.node, link_rx));
    }

    // Incoming connections.
    let prev = placement.stages[(index + placement.stages.len() - 1) % placement.stages.len()].node;
    tokio::spawn(accept_task(node.clone(), prev, index == 0, limits, events_tx.clone()));

    let mut actor = Actor {
        index,
        is_tail: index + 1 == placement.stages.len(),
        chunk: info.chunk as usize,
        n_ctx: info.n_ctx_per_session,
        n_embd: info.n_embd,
        dtype,
        samplers,
        sessions: HashMap::new(),
        work: work_tx,
        link: link_tx,
        local: if next_is_self { Some(events_tx.clone()) } else { None },
        next_session: u64::from(rand_u32()) << 32,
    };
    tracing::info!(stage = %info.layers, addr = ?node.local_addr().ok(), "serving");
    while let Some(ev) = events.recv().await {
        actor.handle(ev).await;
    }
    Ok(())
}

/// The actor's state.
struct Actor {
    index: usize,
    is_tail: bool,
    chunk: usize,
    n_ctx: u32,
    n_embd: u32,
    dtype: Dtype,
    samplers: SamplerFactory,
    sessions: HashMap<u64, Session>,
    work: std::sync::mpsc::Sender<Work>,
    link: mpsc::Sender<Frame>,
    /// Set when this node's next is itself (a one-stage placement).
    local: Option<mpsc::Sender<Event>>,
    /// Session ids this coordinator hands out.
    next_session: u64,
}

impl Actor {
    async fn send_next(&mut self, frame: Frame) {
        let sent = match &self.local {
            Some(me) => me.send(Event::Frame(frame)).await.is_ok(),
            None => self.link.send(frame).await.is_ok(),
        };
        if !sent {
            tracing::error!("the link task has stopped");
        }
    }

    fn submit(&self, job: Job) {
        // The stage thread lives as long as the actor; a send fails only at shutdown.
        let _ = self.work.send(Work::Forward(job));
    }

    fn free(&mut self, session: u64) {
        self.sessions.remove(&session);
        let _ = self.work.send(Work::Free(session));
    }

    async fn handle(&mut self, ev: Event) {
        match ev {
            Event::Generate(req, events) => self.start(req, events).await,
            Event::Frame(f) => self.on_frame(f).await,
            Event::Done(job, result) => self.on_done(job, result).await,
        }
    }

    /// Coordinator: a new generation.
    async fn start(&mut self, req: GenerateRequest, events: mpsc::Sender<GenEvent>) {
        let fail = |m: String| async {
            let _ = events.send(GenEvent::Error(m)).await;
        };
        if self.index != 0 {
            return fail("this node is not the coordinator".into()).await;
        }
        if req.prompt.is_empty() || req.max_new == 0 {
            return fail("empty prompt or nothing to generate".into()).await;
        }
        if req.prompt.len() + req.max_new as usize > self.n_ctx as usize {
            return fail(format!(
                "prompt of {} tokens + {} new tokens exceeds the context of {}",
                req.prompt.len(),
                req.max_new,
                self.n_ctx
            ))
            .await;
        }
        self.next_session += 1;
        let session = self.next_session;
        let epoch = 0;
        // Invariant: a JSON value always serialises.
        let params = serde_json::to_vec(&req.sampling).expect("JSON value serialises");
        let chunks: Vec<Vec<TokenId>> = req.prompt.chunks(self.chunk).map(<[TokenId]>::to_vec).collect();
        let last = chunks.len() as u32 - 1;
        self.sessions.insert(
            session,
            Session {
                epoch,
                tail: None,
                driver: Some(Driver {
                    events,
                    max_new: req.max_new as usize,
                    stop: req.stop,
                    tokens: Vec::new(),
                    pos: req.prompt.len() as u32,
                    awaiting: last,
                    started: Instant::now(),
                    first_token: None,
                    last_token: None,
                }),
            },
        );
        if self.is_tail {
            self.open_tail(session, epoch, &params).await;
        } else {
            self.send_next(Frame::message(FrameKind::Open, session, 0, epoch, params)).await;
        }
        let mut pos = 0;
        for (step, tokens) in chunks.into_iter().enumerate() {
            let n = tokens.len() as u32;
            let flags = if step as u32 == last { FLAG_SAMPLE } else { 0 };
            self.submit(Job { session, epoch, step: step as u32, first_pos: pos, flags, input: Input::Tokens(tokens) });
            pos += n;
        }
    }

    /// Tail: set up sampling for a session.
    async fn open_tail(&mut self, session: u64, epoch: u32, params: &[u8]) {
        let sampler = serde_json::from_slice(params).map_err(|e| e.to_string()).and_then(|v| (self.samplers)(&v));
        match sampler {
            Ok(s) => {
                let entry = self.sessions.entry(session).or_insert(Session { epoch, tail: None, driver: None });
                entry.tail = Some((s, blake3::Hasher::new()));
            }
            Err(e) => self.send_error(session, epoch, format!("bad sampling parameters: {e}")).await,
        }
    }

    /// Report a failure of `session` to the coordinator.
    async fn send_error(&mut self, session: u64, epoch: u32, message: String) {
        tracing::warn!(session, "{message}");
        if self.index == 0 {
            self.fail(session, epoch, message).await;
        } else {
            self.send_next(Frame::message(FrameKind::Error, session, 0, epoch, message.into_bytes())).await;
        }
    }

    /// Coordinator: end a generation with an error and free it along the chain.
    async fn fail(&mut self, session: u64, epoch: u32, message: String) {
        if let Some(d) = self.sessions.get_mut(&session).and_then(|s| s.driver.take()) {
            let _ = d.events.send(GenEvent::Error(message)).await;
            self.free(session);
            if !self.is_tail {
                self.send_next(Frame::message(FrameKind::Close, session, 0, epoch, Vec::new())).await;
            }
        }
    }

    async fn on_frame(&mut self, f: Frame) {
        let known = self.sessions.get(&f.session).map(|s| s.epoch);
        match f.kind {
            FrameKind::Open if self.index == 0 && !self.is_tail => {
                tracing::warn!(session = f.session, "Open frame came back to the coordinator; dropped");
            }
            FrameKind::Open => {
                if self.is_tail {
                    self.open_tail(f.session, f.epoch, &f.payload).await;
                } else {
                    self.sessions.insert(f.session, Session { epoch: f.epoch, tail: None, driver: None });
                    self.send_next(f).await;
                }
            }
            FrameKind::Hidden => match known {
                Some(epoch) if epoch == f.epoch => {
                    let (session, epoch, step, first_pos, flags) = (f.session, f.epoch, f.step, f.first_pos, f.flags);
                    let input = Input::Hidden(f.hidden_values());
                    self.submit(Job { session, epoch, step, first_pos, flags, input });
                }
                Some(epoch) => {
                    tracing::warn!(session = f.session, epoch = f.epoch, current = epoch, "stale frame dropped")
                }
                None => {
                    self.send_error(f.session, f.epoch, format!("stage {}: unknown session {}", self.index, f.session))
                        .await
                }
            },
            FrameKind::Token => self.on_token(f).await,
            FrameKind::Close => {
                if self.index == 0 {
                    self.finish(f).await;
                } else if self.is_tail {
                    let digest = self
                        .sessions
                        .get_mut(&f.session)
                        .and_then(|s| s.tail.take())
                        .map_or(String::new(), |(_, h)| h.finalize().to_hex().to_string());
                    self.free(f.session);
                    self.send_next(Frame::message(FrameKind::Close, f.session, f.step, f.epoch, digest.into_bytes()))
                        .await;
                } else {
                    self.free(f.session);
                    self.send_next(f).await;
                }
            }
            FrameKind::Error => {
                if self.index == 0 {
                    let message = String::from_utf8_lossy(&f.payload).into_owned();
                    self.fail(f.session, f.epoch, message).await;
                } else {
                    self.send_next(f).await;
                }
            }
        }
    }

    /// Coordinator: the tail sampled a token.
    async fn on_token(&mut self, f: Frame) {
        let Some(&token) = f.token_ids().first() else { return };
        let is_tail = self.is_tail;
        let Some(s) = self.sessions.get_mut(&f.session) else { return };
        let Some(d) = s.driver.as_mut() else { return };
        if f.step != d.awaiting || f.epoch != s.epoch {
            tracing::debug!(session = f.session, step = f.step, "duplicate or stale token dropped");
            return;
        }
        let now = Instant::now();
        d.first_token.get_or_insert(now);
        d.last_token = Some(now);
        d.tokens.push(token);
        let _ = d.events.send(GenEvent::Token(token)).await;
        let epoch = s.epoch;
        if d.tokens.len() >= d.max_new || d.stop.contains(&token) {
            // Done: the Close frame travels the chain, the tail answers with its digest.
            let close = Frame::message(FrameKind::Close, f.session, f.step, epoch, Vec::new());
            if is_tail {
                self.on_frame_close_local(close).await;
            } else {
                let _ = self.work.send(Work::Free(f.session));
                self.send_next(close).await;
            }
            return;
        }
        d.awaiting += 1;
        let (step, pos) = (d.awaiting, d.pos);
        d.pos += 1;
        self.submit(Job {
            session: f.session,
            epoch,
            step,
            first_pos: pos,
            flags: FLAG_SAMPLE,
            input: Input::Tokens(vec![token]),
        });
    }

    /// One-stage placement: the coordinator is the tail; finish locally.
    async fn on_frame_close_local(&mut self, close: Frame) {
        let digest = self
            .sessions
            .get_mut(&close.session)
            .and_then(|s| s.tail.take())
            .map_or(String::new(), |(_, h)| h.finalize().to_hex().to_string());
        let mut f = close;
        f.payload = digest.into_bytes();
        self.finish(f).await;
    }

    /// Coordinator: the tail's Close (with its logits digest) ends the generation.
    async fn finish(&mut self, f: Frame) {
        let Some(mut s) = self.sessions.remove(&f.session) else { return };
        let _ = self.work.send(Work::Free(f.session));
        let Some(d) = s.driver.take() else { return };
        let first = d.first_token.unwrap_or(d.started);
        let last = d.last_token.unwrap_or(first);
        let decode = last - first;
        let report = Report {
            tok_per_s: if d.tokens.len() > 1 && !decode.is_zero() {
                (d.tokens.len() - 1) as f64 / decode.as_secs_f64()
            } else {
                0.0
            },
            tokens: d.tokens,
            logits_digest: String::from_utf8_lossy(&f.payload).into_owned(),
            prefill_s: (first - d.started).as_secs_f64(),
            decode_s: decode.as_secs_f64(),
        };
        let _ = d.events.send(GenEvent::Done(report)).await;
    }

    async fn on_done(&mut self, job: Job, result: Result<StageOutput, StageError>) {
        let out = match result {
            Ok(out) => out,
            Err(e) => return self.send_error(job.session, job.epoch, format!("stage {}: {e}", self.index)).await,
        };
        match out {
            StageOutput::Hidden(h) => {
                let mut f = Frame::hidden(job.session, job.step, job.epoch, job.first_pos, &h, self.n_embd, self.dtype);
                f.flags = job.flags;
                self.send_next(f).await;
            }
            StageOutput::Logits(logits) => {
                if job.flags & FLAG_SAMPLE == 0 {
                    return;
                }
                let Some((sampler, digest)) = self.sessions.get_mut(&job.session).and_then(|s| s.tail.as_mut()) else {
                    return self.send_error(job.session, job.epoch, "tail: session was not opened".into()).await;
                };
                let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
                digest.update(&bytes);
                let token = sampler.sample(&logits);
                let n = match job.input {
                    Input::Tokens(t) => t.len() as u32,
                    Input::Hidden(h) => (h.len() / self.n_embd as usize) as u32,
                };
                let f = Frame::tokens(job.session, job.step, job.epoch, job.first_pos + n, &[token]);
                if self.index == 0 {
                    self.on_token(f).await;
                } else {
                    self.send_next(f).await;
                }
            }
        }
    }
}

fn stage_thread(mut stage: Box<dyn Stage>, work: std::sync::mpsc::Receiver<Work>, done: mpsc::Sender<Event>) {
    while let Ok(w) = work.recv() {
        match w {
            Work::Free(s) => stage.free_session(SessionId(s)),
            Work::Forward(job) => {
                let input = match &job.input {
                    Input::Tokens(t) => StageInput::Tokens(t),
                    Input::Hidden(h) => StageInput::Hidden(h),
                };
                let out = stage.forward(SessionId(job.session), job.first_pos, input);
                if done.blocking_send(Event::Done(job, out)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Sends frames to the next node over one ordered stream, reconnecting with jittered
/// exponential backoff (from 5 ms up to 1 s) when the link is down — including at
/// startup, when the next node may not be listening yet.
async fn link_task(node: Arc<Node>, addr: std::net::SocketAddr, peer: NodeId, mut frames: mpsc::Receiver<Frame>) {
    let mut stream: Option<quinn::SendStream> = None;
    let mut pending: Option<Vec<u8>> = None;
    let mut backoff = Duration::from_millis(5);
    loop {
        let bytes = match pending.take() {
            Some(b) => b,
            None => match frames.recv().await {
                Some(f) => {
                    let body = f.encode();
                    let mut b = Vec::with_capacity(4 + body.len());
                    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    b.extend_from_slice(&body);
                    b
                }
                None => return,
            },
        };
        if stream.is_none() {
            match node.connect(addr, peer, alpn::PIPELINE).await {
                Ok(conn) => match conn.open_uni().await {
                    Ok(s) => {
                        backoff = Duration::from_millis(5);
                        stream = Some(s);
                    }
                    Err(e) => tracing::debug!(%addr, "open stream: {e}"),
                },
                Err(e) => tracing::debug!(%addr, "connect: {e}"),
            }
        }
        let ok = match stream.as_mut() {
            Some(s) => s.write_all(&bytes).await.is_ok(),
            None => false,
        };
        if !ok {
            stream = None;
            pending = Some(bytes);
            let jitter = Duration::from_micros(u64::from(rand_u32() % 1000) * backoff.as_micros() as u64 / 2000);
            tokio::time::sleep(backoff + jitter).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

/// Accepts connections: pipeline frames only from the previous stage's node; control
/// requests (coordinator only) from any trusted key.
async fn accept_task(
    node: Arc<Node>,
    prev: NodeId,
    coordinator: bool,
    limits: FrameLimits,
    events: mpsc::Sender<Event>,
) {
    while let Some(acc) = node.accept().await {
        let events = events.clone();
        if acc.alpn == alpn::PIPELINE {
            if acc.peer != prev {
                tracing::warn!(peer = %acc.peer, "pipeline connection from a node that is not the previous stage; closed");
                acc.conn.close(1u32.into(), b"not the previous stage");
                continue;
            }
            tokio::spawn(read_frames(acc.conn, limits, events));
        } else if acc.alpn == alpn::CONTROL && coordinator {
            tokio::spawn(serve_control(acc.conn, events));
        } else {
            acc.conn.close(1u32.into(), b"protocol not served here");
        }
    }
}

/// Reads length-prefixed frames; malformed ones are logged and skipped.
async fn read_frames(conn: quinn::Connection, limits: FrameLimits, events: mpsc::Sender<Event>) {
    let max = HEADER_LEN + (limits.max_tokens as usize * limits.n_embd as usize * 4).max(limits.max_message as usize);
    while let Ok(mut rx) = conn.accept_uni().await {
        loop {
            let mut len = [0u8; 4];
            if rx.read_exact(&mut len).await.is_err() {
                break;
            }
            let len = u32::from_le_bytes(len) as usize;
            if len > max {
                tracing::warn!(len, max, "frame too large; stream dropped");
                let _ = rx.stop(1u32.into());
                break;
            }
            let mut buf = vec![0u8; len];
            if rx.read_exact(&mut buf).await.is_err() {
                break;
            }
            match Frame::decode(&buf, &limits) {
                Ok(f) => {
                    if events.send(Event::Frame(f)).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!("malformed frame rejected: {e}"),
            }
        }
    }
}

/// One generation per bidirectional stream: a JSON request in, JSON lines out.
async fn serve_control(conn: quinn::Connection, events: mpsc::Sender<Event>) {
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let events = events.clone();
        tokio::spawn(async move {
            let reply = |e: GenEvent| {
                // Invariant: events are plain data and always serialise.
                let mut line = serde_json::to_vec(&e).expect("event serialises");
                line.push(b'\n');
                line
            };
            let req =
                match recv.read_to_end(MAX_REQUEST).await.map_err(|e| e.to_string()).and_then(|b| {
                    serde_json::from_slice::<GenerateRequest>(&b).map_err(|e| format!("bad request: {e}"))
                }) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = send.write_all(&reply(GenEvent::Error(e))).await;
                        let _ = send.finish();
                        return;
                    }
                };
            let (tx, mut rx) = mpsc::channel(64);
            if events.send(Event::Generate(req, tx)).await.is_err() {
                return;
            }
            while let Some(ev) = rx.recv().await {
                let end = !matches!(ev, GenEvent::Token(_));
                if send.write_all(&reply(ev)).await.is_err() {
                    return;
                }
                if end {
                    break;
                }
            }
            let _ = send.flush().await;
            let _ = send.finish();
            let _ = send.stopped().await;
        });
    }
}

/// A little randomness for session ids and jitter, without a crate: std's hasher is
/// randomly keyed per process.
fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        Instant::now().elapsed().as_nanos()
            ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}
