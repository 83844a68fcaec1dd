//! The pipeline's protocol core: one node's sessions as a deterministic state machine
//! with no I/O, no threads and no clock of its own (quinn-proto style). Inputs are
//! frames from the network, finished stage steps, client requests and clock ticks;
//! outputs are [`Action`]s the async shell (`service.rs`) carries out. This is what lets
//! a simulation drive thousands of steps through drops, duplicates, reorders and
//! restarts in milliseconds.
//!
//! Recovery, in short:
//! - Every stage is idempotent per step: a step re-run at the same positions rolls the
//!   KV back and recomputes (the `Stage` contract); within an epoch a step already
//!   handled is a duplicate and dropped; frames of an older epoch are stale.
//! - The tail samples each step once and keeps the token: a re-sent step gets the same
//!   token back without advancing the sampler or the logits digest.
//! - The coordinator re-drives the step whose token is late, in a new epoch. A stage
//!   that lacks the positions before a step (it restarted, or frames were lost with a
//!   broken connection) answers `Lost`, and the coordinator replays the session from
//!   position 0 *in its original shapes* (prompt chunks of C, then one token per step),
//!   so every stage's numbers, and so the output, stay bit-identical.
//! - A replay or re-drive recomputes only what was lost: a stage that still holds a
//!   step (it computed it, and has computed nothing before it since) sends on what it
//!   answered then ([`ReplayCache`]) instead of computing it again, so after one stage's
//!   restart only that stage recomputes the session, with its inputs arriving in a
//!   burst rather than one ring trip per step.
//! - A generation that makes no progress fails with a clear error after a bound: no
//!   answer from the ring for `max_wait`, or `max_replays` replays in a row without a
//!   new token (a stage in a crash loop), naming the stage when it is known.
//!
//! Sessions are freed on every stage:
//! - when the generation closes (the Close travels the ring);
//! - at once when a restarted coordinator's first Open arrives: session ids carry the
//!   coordinator's *incarnation* (its start time, see [`session_id`]) and a stage frees
//!   every session of an older incarnation when it sees an Open of a newer one, so the
//!   stage's slots are free for the new coordinator;
//! - after `session_idle` without a frame (a coordinator that died for good).

use crate::protocol::{GenEvent, GenerateRequest, Report};
use shoal_net::frame::{FLAG_SAMPLE, FLAG_VERIFY};
use shoal_net::{Dtype, Frame, FrameKind};
use shoal_types::speculative::{self, DecodeStep, DraftSource, Proposer, SpecSettings};
use shoal_types::{LogitsDigest, TokenId, TokenLogprobs, TokenSampler};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Makes the tail's sampler for a session from the request's sampling parameters.
pub type SamplerFactory = Arc<dyn Fn(&serde_json::Value) -> Result<Box<dyn TokenSampler>, String> + Send + Sync>;

/// Identifies a waiting client at the coordinator.
pub type ClientId = u64;

/// What a node's core reacts to.
pub enum Input {
    /// A frame from the previous node in the ring.
    Frame(Frame),
    /// The stage finished (or refused) a job.
    Done(Job, Result<StepOutput, String>),
    /// A client asks for a generation (coordinator only).
    Generate(GenerateRequest, ClientId),
    /// The same, with its start computed already ([`Prepared::new`], which the shell
    /// runs off the event loop where a draft model computes).
    GeneratePrepared(GenerateRequest, ClientId, Prepared),
    /// The client is gone or does not read its events: end its generation (coordinator
    /// only) and free its session along the ring.
    Cancel(ClientId),
    /// Time passes.
    Tick,
    /// Stage `k` of the ring has just (re)started (it said so over an authenticated
    /// connection): whatever it held is gone, so every generation's awaited step is
    /// re-driven now rather than at its deadline, and the restarted stage's `Lost`
    /// starts the replay at once (coordinator only). A generation already replaying
    /// because that stage said it lost the session is left to finish its replay (the
    /// announcement can come after the `Lost`, when the stage's link was down).
    StageStarted(usize),
    /// The ring's link into this node was connected anew after its connection closed
    /// (an outage past QUIC's idle timeout, or the previous node's restart): what was
    /// in flight on the old connection is gone, so every generation's awaited step is
    /// re-driven now rather than at its deadline (coordinator only).
    LinkRenewed,
}

/// A stage's result, in the core's terms.
pub enum StepOutput {
    /// Hidden states for the next stage.
    Hidden(Vec<f32>),
    /// The tail's logits for the last token of the step, or for every token of a
    /// verify step ([`FLAG_VERIFY`]).
    Logits(Vec<f32>),
    /// The stage does not hold the positions before the step (restarted, or frames lost).
    Gap,
}

/// What the shell must do.
#[derive(Debug)]
pub enum Action {
    /// Send a frame to the next node in the ring.
    Send(Frame),
    /// Run a step on this node's stage.
    Submit(Job),
    /// Free a session on this node's stage.
    Free(u64),
    /// Tell a client something.
    Reply(ClientId, GenEvent),
    /// The connection to the next node is stale: drop it and connect again. The tail
    /// says so when the coordinator restarted: its old connection would swallow frames
    /// until QUIC's idle timeout noticed the peer is gone.
    RenewLink,
}

/// One step for the stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub session: u64,
    pub epoch: u32,
    pub step: u32,
    pub first_pos: u32,
    pub flags: u8,
    pub input: JobInput,
    /// A verify step's input token ids ([`FLAG_VERIFY`]: the last emitted token, then
    /// the drafts), passed along the ring to the tail; empty otherwise.
    pub step_tokens: Vec<TokenId>,
}

/// A job's input.
#[derive(Clone, Debug, PartialEq)]
pub enum JobInput {
    Tokens(Vec<TokenId>),
    Hidden(Vec<f32>),
}

impl JobInput {
    fn n_tokens(&self, n_embd: u32) -> u32 {
        match self {
            JobInput::Tokens(t) => t.len() as u32,
            JobInput::Hidden(h) => (h.len() / n_embd.max(1) as usize) as u32,
        }
    }
}

/// Timing of re-drives and give-ups.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// A step's token is late after max(this, 8 × the recent step time).
    pub min_timeout: Duration,
    /// The generation fails when the ring has answered nothing for this long: no token
    /// of the current epoch came back and the coordinator's own stage finished no step
    /// it had not finished before (re-drives and replays do not count). Default 60 s.
    pub max_wait: Duration,
    /// The generation fails after this many replays in a row without a new token: a
    /// stage that keeps losing the session (a crash loop) cannot hold it forever.
    /// Default 8.
    pub max_replays: u32,
    /// A stage forgets a session it has not heard of for this long (its coordinator
    /// died for good or gave up); longer than `max_wait`, so no live generation is cut.
    /// A restarted coordinator does not wait for this: its first Open frees the
    /// sessions of its previous incarnation at once. Default 120 s.
    pub session_idle: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            min_timeout: Duration::from_millis(1500),
            max_wait: Duration::from_secs(60),
            max_replays: 8,
            session_idle: Duration::from_secs(120),
        }
    }
}

/// The longest the coordinator waits before re-driving an unanswered step (unless a
/// step takes longer than a quarter of it): the bound on how long after a fault heals
/// the ring is tried again.
pub const MAX_REDRIVE_WAIT: Duration = Duration::from_secs(2);

/// Bits of a session id that count the coordinator's sessions; the bits above hold
/// its incarnation.
pub const SESSION_COUNTER_BITS: u32 = 24;
/// Bits of an incarnation (ms since 2020-01-01 fit in 40 bits until 2054; comparisons
/// wrap, so later years keep working).
pub const INCARNATION_BITS: u32 = 64 - SESSION_COUNTER_BITS;
const INCARNATION_MASK: u64 = (1 << INCARNATION_BITS) - 1;
const COUNTER_MASK: u64 = (1 << SESSION_COUNTER_BITS) - 1;

/// A session id: the coordinator's incarnation above, its session counter below.
pub fn session_id(incarnation: u64, counter: u64) -> u64 {
    (incarnation & INCARNATION_MASK) << SESSION_COUNTER_BITS | counter & COUNTER_MASK
}

/// The incarnation of the coordinator that opened `session`.
pub fn incarnation_of(session: u64) -> u64 {
    session >> SESSION_COUNTER_BITS
}

/// Whether incarnation `a` started after `b` (serial-number arithmetic over
/// [`INCARNATION_BITS`], so the comparison survives the wrap).
pub fn is_newer(a: u64, b: u64) -> bool {
    let d = a.wrapping_sub(b) & INCARNATION_MASK;
    d != 0 && d < 1 << (INCARNATION_BITS - 1)
}

/// Static facts about the node.
#[derive(Clone)]
pub struct CoreConfig {
    /// This node's stage index; 0 is the coordinator.
    pub index: usize,
    /// Stages in the ring.
    pub n_stages: usize,
    /// Prefill chunk size C.
    pub chunk: u32,
    /// Positions per session.
    pub n_ctx: u32,
    /// Hidden-state width.
    pub n_embd: u32,
    /// Wire type of hidden states.
    pub dtype: Dtype,
    /// Sampler factory (tail).
    pub samplers: SamplerFactory,
    /// Re-drive timing (coordinator).
    pub retry: RetryPolicy,
    /// A draft model (coordinator): speculating generations draft with a proposer of
    /// its own in place of prompt lookup. It computes inline when asked, as stage 0
    /// does; `None`: prompt lookup.
    pub drafts: Option<Arc<dyn DraftSource>>,
}

/// What a generation starts with, a function of the request and the coordinator's
/// settings alone: its speculation settings (priced for the draft model), its proposer
/// (which has read the prompt) and, for a resumed generation, every step it had in
/// their original shapes plus the next. Computing it may run the draft model over the
/// prompt and, for a resumed generation, over every step it replays, so the shell
/// computes it on a blocking thread ([`Input::GeneratePrepared`]) rather than in the
/// event loop that moves every other session's frames.
pub struct Prepared {
    spec: SpecSettings,
    proposer: Option<Box<dyn Proposer>>,
    steps: Vec<DecodeStep>,
}

impl Prepared {
    /// `req`'s start on a coordinator with draft model `drafts` (none: prompt lookup),
    /// `n_ctx` positions per session and prefill chunk `chunk`; an error where the
    /// request is out of bounds.
    pub fn new(
        drafts: Option<&Arc<dyn DraftSource>>,
        n_ctx: u32,
        chunk: u32,
        req: &GenerateRequest,
    ) -> Result<Prepared, String> {
        // Every bound (prompt and answer within the context, sampling parameters that
        // cannot make the tail's sampler misbehave or allocate) is checked here, before
        // the session exists anywhere.
        req.validate(n_ctx)?;
        let logprobs = req.sampling.get("logprobs").is_some_and(|v| !v.is_null());
        let mut spec = req.speculative.filter(|s| s.is_on() && !logprobs).unwrap_or(SpecSettings::OFF);
        if let Some(d) = drafts {
            spec = spec.priced_for(d.cost());
        }
        // With a draft model, a fresh session reads the prompt first, as every run's
        // does (the engine's `Chain` too), so its later answers are computed alike.
        let mut proposer = drafts.filter(|_| spec.is_on()).map(|d| d.proposer());
        if let Some(p) = proposer.as_deref_mut() {
            // A failure leaves the session to recompute at its first call.
            let _ = p.read_prompt(&req.prompt);
        }
        // A resumed generation starts as a replay would: every step up to the one after
        // the tokens it already has, in their original shapes, which the tokens and the
        // settings determine (validate bounded them below max_new, so the steps fit the
        // context). The rebuilt schedule asks the fresh session what the first run asked
        // its own, so it drafts what that one drafted.
        let (n_ctx, max_new) = (n_ctx as usize, req.max_new as usize);
        let mut steps = speculative::schedule_of_with(
            &req.prompt,
            &req.resume,
            &spec,
            max_new,
            n_ctx,
            chunk,
            &req.stop,
            proposer.as_deref_mut(),
        );
        if !req.resume.is_empty() {
            let limits = speculative::limits_at(req.prompt.len(), req.resume.len(), max_new, n_ctx, chunk, &req.stop);
            let drafts =
                speculative::next_draft_with(&req.prompt, &req.resume, &steps, &spec, &limits, proposer.as_deref_mut());
            steps.push(DecodeStep { n_before: req.resume.len(), drafts });
        }
        Ok(Prepared { spec, proposer, steps })
    }
}

/// A session as one node sees it.
struct Session {
    /// Current epoch; frames of older epochs are stale.
    epoch: u32,
    /// Highest step handled in this epoch (duplicates are dropped).
    last_step: Option<u32>,
    /// The last step this node's stage was given or answered from its replay cache, in
    /// any epoch (stages). A step more than one past it means frames were lost in between, and the positions the stage
    /// holds past the last step's first may be drafts the lost steps rejected and
    /// replaced: only a replay makes them right (without speculation the stage sees the
    /// gap in positions by itself).
    submitted: Option<u32>,
    /// Sampling parameters (kept to re-open the session after a restart).
    params: serde_json::Value,
    /// What this stage answered for the steps it computed, to answer a replay without
    /// computing them again.
    cache: ReplayCache,
    /// Tail only.
    tail: Option<TailState>,
    /// Coordinator only.
    driver: Option<Driver>,
}

/// Most bytes of answers a session's [`ReplayCache`] holds on one stage: a 70B model's
/// hidden states (8192 wide, f16) for a 4096-position session are 64 MiB. Steps past
/// the bound are recomputed by a replay, as without a cache.
const MAX_REPLAY_CACHE: usize = 256 << 20;

/// A stage's answers to the steps of one session it has computed, so that a replay
/// (another stage restarted) or a re-drive (a frame was lost downstream) does not
/// compute them again here.
///
/// Sending a kept answer instead of computing is exact only while the stage's KV still
/// holds that step's positions as computed: every step's positions are written by
/// computing it, and computing a step rolls back everything after its first position.
/// So a step may be answered from here iff it is at or before the last step computed
/// (`computed`, in any epoch: the positions of every step up to it are in place, drafts
/// that later steps rejected included, as the replay will have them), and the stage
/// never said it lacked positions (a `Gap`, after which nothing here is trusted). Once
/// a replay computes a step, the steps after it are computed too. Steps still arrive in
/// order ([`Session::submitted`] counts answered steps too), so the tail samples each
/// step, and feeds the logits digest, in step order.
#[derive(Default)]
struct ReplayCache {
    /// By step: what was answered, and the positions it covered (a step of another
    /// shape is not the same step).
    steps: HashMap<u32, (u32, u32, Answer)>,
    /// Payload bytes held (bounded by [`MAX_REPLAY_CACHE`]).
    bytes: usize,
    /// The last step handed to the stage to compute, in any epoch.
    computed: Option<u32>,
    /// The stage lacked positions once: its KV is not what `steps` assumes.
    broken: bool,
}

/// What a stage answered for one step.
#[derive(Clone)]
enum Answer {
    /// Hidden states for the next stage (the frame as sent, epoch aside).
    Hidden(Frame),
    /// The tail's tokens, in `TailState::sampled`.
    Sampled,
    /// The tail ran a prompt chunk that samples nothing.
    Quiet,
}

impl ReplayCache {
    /// Keep `answer` for `step` (positions `first_pos..first_pos + n`).
    fn keep(&mut self, step: u32, first_pos: u32, n: u32, answer: Answer) {
        let size = match &answer {
            Answer::Hidden(f) => f.payload.len(),
            Answer::Sampled | Answer::Quiet => 0,
        };
        if self.broken || self.bytes + size > MAX_REPLAY_CACHE {
            return;
        }
        if let Some((_, _, Answer::Hidden(old))) = self.steps.insert(step, (first_pos, n, answer)) {
            self.bytes -= old.payload.len();
        }
        self.bytes += size;
    }

    /// The kept answer for `step` at `first_pos..first_pos + n`, if the stage may send
    /// it instead of computing (see the type's doc).
    fn answer(&self, step: u32, first_pos: u32, n: u32) -> Option<&Answer> {
        if self.broken || self.computed.is_none_or(|l| step > l) {
            return None;
        }
        self.steps.get(&step).filter(|(p, k, _)| (*p, *k) == (first_pos, n)).map(|(_, _, a)| a)
    }

    /// The stage lacked positions: trust nothing kept.
    fn lost(&mut self) {
        *self = ReplayCache { broken: true, ..ReplayCache::default() };
    }
}

/// The tail's answer to one step: its tokens, and the token's log-probabilities when
/// the request asked for them.
type Sampled = (Vec<TokenId>, Option<TokenLogprobs>);

struct TailState {
    sampler: Box<dyn TokenSampler>,
    digest: LogitsDigest,
    /// Tokens sampled at each step (by step number: one, or a verify step's several),
    /// with the token's log-probabilities when asked for: a re-sent step answers the
    /// same without sampling again.
    sampled: HashMap<u32, Sampled>,
    /// Alternatives per token's log-probabilities (`SamplingParams::logprobs`); `None`:
    /// the request wants none (nothing computed).
    logprobs: Option<usize>,
}

/// The coordinator's view of a generation.
struct Driver {
    client: ClientId,
    prompt: Vec<TokenId>,
    max_new: usize,
    stop: Vec<TokenId>,
    tokens: Vec<TokenId>,
    /// Steps taken by the prompt (its chunks).
    prompt_steps: u32,
    /// How this generation speculates (off when the request asks for log-probabilities:
    /// a Token frame carries those for one token).
    spec: SpecSettings,
    /// The draft model's session for this generation (when the node has one and the
    /// generation speculates), asked for each step's drafts.
    proposer: Option<Box<dyn Proposer>>,
    /// The decode steps so far, in order (step `prompt_steps + i` is `steps[i]`): which
    /// token and drafts each carried, so re-drives and replays send them in their
    /// original shapes. The last is the step awaited.
    steps: Vec<DecodeStep>,
    /// The step whose token we wait for (or, when `closing`, the Close).
    awaiting: u32,
    closing: bool,
    /// When the current step was sent, and when it is late.
    sent_at: Instant,
    deadline: Instant,
    /// Last time anything moved.
    progress_at: Instant,
    /// Smoothed step time, from steps that answered (never from timeouts).
    ewma: Duration,
    /// Re-drives in a row with no answer from the ring in between: each doubles the
    /// wait before the next, up to [`MAX_REDRIVE_WAIT`]; any answer in the current epoch
    /// resets it, so the first re-drive after a fault heals comes within seconds.
    backoff: u32,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Re-drives and replays so far (for logs and counters).
    redrives: u32,
    replays: u32,
    /// Replays since the last new token (bounded by `max_replays`).
    replays_in_row: u32,
    /// The stage that last said it lost the session (from its Lost frame), if known.
    lost_at: Option<usize>,
    /// The stage whose `Lost` started the current epoch's replay (none once a re-drive
    /// opened a newer epoch).
    replaying_for: Option<usize>,
    /// Highest step the coordinator's own stage has finished: finishing a higher one
    /// (a prompt chunk on its first pass) is progress, recomputing one is not.
    head_done: Option<u32>,
    /// All tokens are in, but the tail lost its digest: the session is being replayed
    /// up to its last step, after which it closes again.
    replaying_finished: bool,
}

/// Counters a node keeps (for `shoal status`, the admin page, `/metrics` later).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    pub frames_in: u64,
    pub frames_out: u64,
    pub stale_dropped: u64,
    pub duplicates_dropped: u64,
    pub redrives: u64,
    pub replays: u64,
    pub lost_reported: u64,
    pub cached_tokens_resent: u64,
    /// Steps a replay or re-drive did not compute again here: this stage still held
    /// them and sent on what it answered before ([`ReplayCache`]).
    #[serde(default)]
    pub replay_skipped: u64,
    /// Generations ended because their client went away or stopped reading (coordinator).
    #[serde(default)]
    pub cancelled: u64,
    /// Generations failed by the no-progress bounds (`max_wait`, `max_replays`).
    #[serde(default)]
    pub gave_up: u64,
    /// Sessions freed because a newer coordinator incarnation opened one (stages).
    #[serde(default)]
    pub orphans_freed: u64,
    /// Sessions freed after `session_idle` without a frame (stages).
    #[serde(default)]
    pub idle_freed: u64,
    /// Speculative decoding (coordinator): verify steps sent, tokens drafted in them,
    /// and drafted tokens the tail accepted.
    #[serde(default)]
    pub verify_steps: u64,
    #[serde(default)]
    pub drafted: u64,
    #[serde(default)]
    pub accepted: u64,
}

/// One node's protocol state.
pub struct NodeCore {
    cfg: CoreConfig,
    sessions: HashMap<u64, Session>,
    /// Final digests of recently closed sessions (tail), to answer a repeated Close.
    closed: VecDeque<(u64, String)>,
    /// This coordinator's incarnation (the high bits of its session ids).
    incarnation: u64,
    /// Counter of the sessions it opened (the low bits).
    next_session: u64,
    /// Stages: the newest coordinator incarnation an Open has come from.
    newest_incarnation: Option<u64>,
    /// When each session was last heard of (frames, finished steps).
    last_seen: HashMap<u64, Instant>,
    /// Public counters.
    pub counters: Counters,
}

impl NodeCore {
    /// A node with no sessions. `incarnation` tells this coordinator's start from any
    /// earlier one: a value that grows from start to start (the shell uses the wall
    /// clock in ms; see [`is_newer`]). Only the coordinator's is used.
    pub fn new(cfg: CoreConfig, incarnation: u64) -> Self {
        Self {
            cfg,
            sessions: HashMap::new(),
            closed: VecDeque::new(),
            incarnation: incarnation & INCARNATION_MASK,
            next_session: 0,
            newest_incarnation: None,
            last_seen: HashMap::new(),
            counters: Counters::default(),
        }
    }

    fn is_tail(&self) -> bool {
        self.cfg.index + 1 == self.cfg.n_stages
    }

    fn is_coordinator(&self) -> bool {
        self.cfg.index == 0
    }

    /// Sessions currently held.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// React to `input` at time `now`.
    pub fn handle(&mut self, input: Input, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        match input {
            Input::Generate(req, client) => {
                match Prepared::new(self.cfg.drafts.as_ref(), self.cfg.n_ctx, self.cfg.chunk, &req) {
                    Ok(p) => self.start(req, client, p, now, &mut out),
                    Err(m) => out.push(Action::Reply(client, GenEvent::Error(m))),
                }
            }
            Input::GeneratePrepared(req, client, p) => self.start(req, client, p, now, &mut out),
            Input::Cancel(client) => self.cancel(client, &mut out),
            Input::Frame(f) => {
                self.counters.frames_in += 1;
                self.last_seen.insert(f.session, now);
                self.on_frame(f, now, &mut out)
            }
            Input::Done(job, result) => {
                self.last_seen.insert(job.session, now);
                self.on_done(job, result, now, &mut out)
            }
            Input::Tick => self.on_tick(now, &mut out),
            Input::StageStarted(k) => self.redrive_now(now, |d| d.replaying_for != Some(k), &mut out),
            Input::LinkRenewed => self.redrive_now(now, |_| true, &mut out),
        }
        self.counters.frames_out += out.iter().filter(|a| matches!(a, Action::Send(_))).count() as u64;
        out
    }

    /// Re-drive now, not at their deadlines, the awaited steps of the generations that
    /// `which` picks (what was in flight toward a restarted stage, or on a closed
    /// connection, is gone).
    fn redrive_now(&mut self, now: Instant, which: impl Fn(&Driver) -> bool, out: &mut Vec<Action>) {
        for d in self.sessions.values_mut().filter_map(|s| s.driver.as_mut()).filter(|d| which(d)) {
            d.deadline = d.deadline.min(now);
            d.backoff = 0;
        }
        self.on_tick(now, out)
    }

    /// Send toward the coordinator; when this node *is* the coordinator (the frame
    /// comes from its own tail in a one-stage ring), handle it here.
    fn send_to_coordinator(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        if self.is_coordinator() {
            self.on_frame(f, now, out);
        } else {
            out.push(Action::Send(f));
        }
    }

    // ---- coordinator -------------------------------------------------------------

    fn start(&mut self, req: GenerateRequest, client: ClientId, p: Prepared, now: Instant, out: &mut Vec<Action>) {
        let fail = |m: String, out: &mut Vec<Action>| out.push(Action::Reply(client, GenEvent::Error(m)));
        if !self.is_coordinator() {
            return fail("this node is not the coordinator".into(), out);
        }
        // Skip 0 in the counter (session 0 marks frames about no session).
        self.next_session = (self.next_session + 1) & COUNTER_MASK;
        if self.next_session == 0 {
            self.next_session = 1;
        }
        let session = session_id(self.incarnation, self.next_session);
        let prompt_steps = req.prompt.len().div_ceil(self.cfg.chunk as usize) as u32;
        let Prepared { spec, proposer, steps } = p;
        let resumed = steps.len() as u32;
        let driver = Driver {
            client,
            prompt: req.prompt,
            max_new: req.max_new as usize,
            stop: req.stop,
            tokens: req.resume,
            prompt_steps,
            spec,
            proposer,
            steps,
            awaiting: prompt_steps - 1 + resumed,
            closing: false,
            sent_at: now,
            deadline: now,
            progress_at: now,
            ewma: Duration::ZERO,
            backoff: 0,
            started: now,
            first_token: None,
            last_token: None,
            redrives: 0,
            replays: 0,
            replays_in_row: 0,
            lost_at: None,
            replaying_for: None,
            head_done: None,
            replaying_finished: false,
        };
        self.sessions.insert(
            session,
            Session {
                epoch: 0,
                last_step: None,
                submitted: None,
                params: req.sampling,
                cache: ReplayCache::default(),
                tail: None,
                driver: Some(driver),
            },
        );
        self.open_and_send(session, 0, now, out);
    }

    /// The input of step `step` of a driven session, in its original shape.
    fn step_input(d: &Driver, chunk: u32, step: u32) -> (u32, Vec<TokenId>, u8) {
        if step < d.prompt_steps {
            let c = chunk as usize;
            let start = step as usize * c;
            let end = (start + c).min(d.prompt.len());
            let flags = if step + 1 == d.prompt_steps { FLAG_SAMPLE } else { 0 };
            (start as u32, d.prompt[start..end].to_vec(), flags)
        } else {
            // Invariant: every step up to the awaited one is in `steps`, and each names
            // at least one emitted token (n_before ≥ 1).
            let s = &d.steps[(step - d.prompt_steps) as usize];
            let mut tokens = Vec::with_capacity(1 + s.drafts.len());
            tokens.push(d.tokens[s.n_before - 1]);
            tokens.extend(&s.drafts);
            let flags = if s.drafts.is_empty() { FLAG_SAMPLE } else { FLAG_SAMPLE | FLAG_VERIFY };
            ((d.prompt.len() + s.n_before - 1) as u32, tokens, flags)
        }
    }

    /// Where the tokens of step `step` start in the emitted tokens (`None` for a prompt
    /// chunk that samples nothing).
    fn first_token_of(d: &Driver, step: u32) -> Option<usize> {
        match step.checked_sub(d.prompt_steps) {
            Some(i) => d.steps.get(i as usize).map(|s| s.n_before),
            None => (step + 1 == d.prompt_steps).then_some(0),
        }
    }

    /// Job for step `step` of a driven session, in its original shape.
    fn job(d: &Driver, chunk: u32, session: u64, epoch: u32, step: u32) -> Job {
        let (first_pos, tokens, flags) = Self::step_input(d, chunk, step);
        let step_tokens = if flags & FLAG_VERIFY != 0 { tokens.clone() } else { Vec::new() };
        Job { session, epoch, step, first_pos, flags, input: JobInput::Tokens(tokens), step_tokens }
    }

    /// (Re)open the session in `epoch` along the ring and send steps `from..=awaiting`.
    fn open_and_send(&mut self, session: u64, from: u32, now: Instant, out: &mut Vec<Action>) {
        let chunk = self.cfg.chunk;
        let tail = self.is_tail();
        let Some(s) = self.sessions.get_mut(&session) else { return };
        s.last_step = None;
        let epoch = s.epoch;
        // Invariant: a JSON value always serialises.
        let params = serde_json::to_vec(&s.params).expect("JSON value serialises");
        let Some(d) = s.driver.as_mut() else { return };
        d.sent_at = now;
        // The first answer comes once the prompt's chunks have gone round (a replay's
        // decode steps then answer one by one, each pushing the deadline on): a step's
        // wait for each chunk still to send, and one for the step after them.
        let before_first_answer = d.prompt_steps.saturating_sub(from) + 1;
        d.deadline = now + Self::timeout(d, self.cfg.retry.min_timeout) * before_first_answer.min(8);
        let jobs: Vec<Job> = (from..=d.awaiting).map(|step| Self::job(d, chunk, session, epoch, step)).collect();
        if tail {
            self.open_tail(session, epoch, &params, now, out);
        } else {
            out.push(Action::Send(Frame::message(FrameKind::Open, session, 0, epoch, params)));
        }
        for job in jobs {
            self.run(job, now, out);
        }
    }

    /// Hand `job` to this node's stage, or, where the stage still holds the step (a
    /// replay or re-drive), send on what it answered before ([`ReplayCache`]).
    fn run(&mut self, job: Job, now: Instant, out: &mut Vec<Action>) {
        let n = job.input.n_tokens(self.cfg.n_embd);
        let Some(s) = self.sessions.get_mut(&job.session) else { return };
        let answer = s.cache.answer(job.step, job.first_pos, n).cloned();
        s.submitted = Some(job.step);
        match answer {
            None => {
                s.cache.computed = Some(job.step);
                out.push(Action::Submit(job));
            }
            Some(answer) => {
                self.counters.replay_skipped += 1;
                self.send_answer(&job, n, answer, now, out);
            }
        }
    }

    /// Send on a kept answer to `job` (in `job`'s epoch).
    fn send_answer(&mut self, job: &Job, n: u32, answer: Answer, now: Instant, out: &mut Vec<Action>) {
        match answer {
            Answer::Hidden(mut f) => {
                f.epoch = job.epoch;
                out.push(Action::Send(f));
            }
            Answer::Quiet => {}
            Answer::Sampled => {
                let sampled = self.sessions.get(&job.session).and_then(|s| s.tail.as_ref()?.sampled.get(&job.step));
                // Invariant: `Sampled` is kept only after the tokens went into `sampled`,
                // which lives as long as the session's tail state.
                let Some((tokens, lp)) = sampled.cloned() else { return };
                self.counters.cached_tokens_resent += 1;
                let f = token_frame(job, job.first_pos + n, &tokens, &lp);
                self.send_to_coordinator(f, now, out);
            }
        }
    }

    /// How long the coordinator waits for a step's answer before re-driving it: 8 step
    /// times (at least `min`), doubled for each re-drive in a row that went unanswered,
    /// but never past [`MAX_REDRIVE_WAIT`] (or 4 step times, for a model slower than
    /// that): a link that comes back, or a stage that restarted, is re-driven within
    /// seconds rather than after a backoff that grew through the fault. A re-drive costs
    /// a frame per stage; waiting costs the user the whole stall.
    fn timeout(d: &Driver, min: Duration) -> Duration {
        let base = (d.ewma * 8).max(min);
        let backed_off = base.saturating_mul(1u32 << d.backoff.min(16));
        backed_off.min(MAX_REDRIVE_WAIT.max(d.ewma * 4)).max(min)
    }

    fn on_token(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        let got = f.token_ids();
        if got.is_empty() {
            return;
        }
        let chunk = self.cfg.chunk;
        let n_ctx = self.cfg.n_ctx as usize;
        let Some(s) = self.sessions.get_mut(&f.session) else { return };
        let current_epoch = f.epoch == s.epoch;
        let Some(d) = s.driver.as_mut() else { return };
        if current_epoch {
            // The ring answers in the current epoch (during a replay: the replayed
            // steps coming back one by one), so the time bound restarts, the backoff
            // ends, and a replay that makes progress is not re-driven half-way.
            d.progress_at = now;
            d.backoff = 0;
            let wait = Self::timeout(d, self.cfg.retry.min_timeout);
            d.deadline = d.deadline.max(now + wait);
        }
        if d.closing || f.step != d.awaiting {
            // Tokens of an earlier step (re-sent during a replay) or a late duplicate.
            if let Some(i) = Self::first_token_of(d, f.step) {
                let had = d.tokens.get(i..(i + got.len()).min(d.tokens.len())).unwrap_or_default();
                if !had.is_empty() && had != &got[..had.len()] {
                    tracing::error!(session = f.session, step = f.step, ?got, ?had, "replay diverged");
                }
            }
            self.counters.duplicates_dropped += 1;
            return;
        }
        // A step answers one token, a verify step up to one more than its drafts; the
        // answer's head must be the drafts themselves (the tail's rule). Anything else
        // is a broken tail: fail rather than emit tokens nobody verified.
        let drafts = d.awaiting.checked_sub(d.prompt_steps).and_then(|i| d.steps.get(i as usize)).map(|s| &s.drafts);
        let drafts: &[TokenId] = drafts.map_or(&[], |v| v.as_slice());
        if got.len() > drafts.len() + 1 || got[..got.len() - 1] != drafts[..got.len() - 1] {
            let message =
                format!("the tail answered {} tokens that do not verify the step's {} drafts", got.len(), drafts.len());
            return self.fail(f.session, message, out);
        }
        let verified = !drafts.is_empty();
        let epoch = s.epoch;
        if d.replaying_finished {
            // A finished generation replayed so the tail could rebuild its digest:
            // its last step is back; close again.
            d.replaying_finished = false;
            d.closing = true;
            d.deadline = now + Self::timeout(d, self.cfg.retry.min_timeout);
            let close = Frame::message(FrameKind::Close, f.session, d.awaiting, epoch, Vec::new());
            self.send_close(close, now, out);
            return;
        }
        if verified {
            self.counters.accepted += got.len() as u64 - 1;
        }
        let step_time = now.saturating_duration_since(d.sent_at);
        d.ewma = if d.ewma.is_zero() { step_time } else { (d.ewma * 7 + step_time) / 8 };
        d.first_token.get_or_insert(now);
        d.last_token = Some(now);
        d.progress_at = now;
        d.replays_in_row = 0;
        let logprobs = f.token_logprobs();
        let mut done = false;
        for token in got {
            d.tokens.push(token);
            let event = match &logprobs {
                Some(lp) => GenEvent::Scored(token, lp.clone()),
                None => GenEvent::Token(token),
            };
            out.push(Action::Reply(d.client, event));
            if d.tokens.len() >= d.max_new || d.stop.contains(&token) {
                // Drafts stop before stop tokens and within max_new, so this is the
                // step's last token.
                done = true;
                break;
            }
        }
        if done {
            d.closing = true;
            d.deadline = now + Self::timeout(d, self.cfg.retry.min_timeout);
            let close = Frame::message(FrameKind::Close, f.session, d.awaiting, epoch, Vec::new());
            self.send_close(close, now, out);
            return;
        }
        // The next step: the last token, and whatever prompt lookup drafts after it.
        let n = d.tokens.len();
        let limits = speculative::limits_at(d.prompt.len(), n, d.max_new, n_ctx, chunk, &d.stop);
        let drafts =
            speculative::next_draft_with(&d.prompt, &d.tokens, &d.steps, &d.spec, &limits, d.proposer.as_deref_mut());
        if !drafts.is_empty() {
            self.counters.drafted += drafts.len() as u64;
            self.counters.verify_steps += 1;
        }
        d.steps.push(DecodeStep { n_before: n, drafts });
        d.awaiting += 1;
        d.sent_at = now;
        d.deadline = now + Self::timeout(d, self.cfg.retry.min_timeout);
        let job = Self::job(d, chunk, f.session, epoch, d.awaiting);
        self.run(job, now, out);
    }

    fn send_close(&mut self, close: Frame, now: Instant, out: &mut Vec<Action>) {
        if self.is_tail() {
            // One-stage ring: the coordinator is the tail.
            let ack = self.tail_close(close, out);
            if ack.kind == FrameKind::Lost {
                self.on_lost(ack, now, out);
            } else {
                self.finish(ack, now, out);
            }
        } else {
            out.push(Action::Send(close));
        }
    }

    /// The tail's Close answer (with its digest) ends the generation.
    fn finish(&mut self, f: Frame, _now: Instant, out: &mut Vec<Action>) {
        let Some(s) = self.sessions.get(&f.session) else { return };
        if !s.driver.as_ref().is_some_and(|d| d.closing) {
            return;
        }
        let Some(mut s) = self.sessions.remove(&f.session) else { return };
        out.push(Action::Free(f.session));
        let Some(d) = s.driver.take() else { return };
        let first = d.first_token.unwrap_or(d.started);
        let last = d.last_token.unwrap_or(first);
        let decode = last.saturating_duration_since(first);
        let n = d.tokens.len();
        let (drafted, accepted) = speculative::tally(&d.steps, n);
        tracing::debug!(session = f.session, redrives = d.redrives, replays = d.replays, "generation finished");
        let report = Report {
            tok_per_s: if n > 1 && !decode.is_zero() { (n - 1) as f64 / decode.as_secs_f64() } else { 0.0 },
            tokens: d.tokens,
            logits_digest: String::from_utf8_lossy(&f.payload).into_owned(),
            prefill_s: first.saturating_duration_since(d.started).as_secs_f64(),
            decode_s: decode.as_secs_f64(),
            decode_steps: d.steps.len() as u64,
            drafted: drafted as u64,
            accepted: accepted as u64,
        };
        out.push(Action::Reply(d.client, GenEvent::Done(report)));
    }

    /// The client of a generation is gone or does not read: end it without a reply and
    /// free its session here and along the ring.
    fn cancel(&mut self, client: ClientId, out: &mut Vec<Action>) {
        let found = self
            .sessions
            .iter()
            .find(|(_, s)| s.driver.as_ref().is_some_and(|d| d.client == client))
            .map(|(&id, _)| id);
        let Some(session) = found else { return };
        let Some(s) = self.sessions.remove(&session) else { return };
        self.counters.cancelled += 1;
        tracing::info!(session, client, "generation cancelled: its client is gone or does not read");
        out.push(Action::Free(session));
        if !self.is_tail() {
            out.push(Action::Send(Frame::message(FrameKind::Close, session, 0, s.epoch, Vec::new())));
        }
    }

    fn fail(&mut self, session: u64, message: String, out: &mut Vec<Action>) {
        let Some(mut s) = self.sessions.remove(&session) else { return };
        out.push(Action::Free(session));
        if let Some(d) = s.driver.take() {
            tracing::warn!(session, "{message}");
            out.push(Action::Reply(d.client, GenEvent::Error(message)));
            if !self.is_tail() {
                out.push(Action::Send(Frame::message(FrameKind::Close, session, 0, s.epoch, Vec::new())));
            }
        }
    }

    /// Re-drive late steps; fail generations that made no progress for too long.
    fn on_tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        // Stages: forget sessions whose coordinator is gone.
        let idle = self.cfg.retry.session_idle;
        let sessions = &self.sessions;
        self.last_seen.retain(|id, _| sessions.contains_key(id));
        let expired: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(id, s)| {
                s.driver.is_none() && self.last_seen.get(id).is_none_or(|t| now.saturating_duration_since(*t) >= idle)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            tracing::info!(session = id, "session idle too long (its coordinator is gone); freed");
            self.sessions.remove(&id);
            self.last_seen.remove(&id);
            self.counters.idle_freed += 1;
            out.push(Action::Free(id));
        }
        let max_wait = self.cfg.retry.max_wait;
        let late: Vec<(u64, bool, bool)> = self
            .sessions
            .iter()
            .filter_map(|(&id, s)| {
                let d = s.driver.as_ref()?;
                let give_up = now.saturating_duration_since(d.progress_at) >= max_wait;
                // The bound holds even while the backed-off deadline lies further out.
                (now >= d.deadline || give_up).then_some((id, give_up, d.closing))
            })
            .collect();
        for (session, give_up, closing) in late {
            if give_up {
                let message = self.no_progress_message(session, max_wait);
                self.counters.gave_up += 1;
                self.fail(session, message, out);
                continue;
            }
            let min = self.cfg.retry.min_timeout;
            let Some(s) = self.sessions.get_mut(&session) else { continue };
            s.epoch += 1;
            let epoch = s.epoch;
            let Some(d) = s.driver.as_mut() else { continue };
            d.redrives += 1;
            d.replaying_for = None;
            self.counters.redrives += 1;
            if closing {
                d.deadline = now + Self::timeout(d, min);
                let close = Frame::message(FrameKind::Close, session, d.awaiting, epoch, Vec::new());
                self.send_close(close, now, out);
                continue;
            }
            // Back off: each unanswered re-drive waits longer (within the bound).
            d.backoff = d.backoff.saturating_add(1);
            let awaiting = d.awaiting;
            tracing::info!(session, step = awaiting, epoch, "token late; re-driving the step");
            self.open_and_send(session, if awaiting < self.prompt_steps(session) { 0 } else { awaiting }, now, out);
        }
    }

    /// Why a generation that made no progress for `max_wait` fails, naming the stage
    /// when the coordinator knows it.
    fn no_progress_message(&self, session: u64, max_wait: Duration) -> String {
        let n = self.cfg.n_stages;
        let Some(d) = self.sessions.get(&session).and_then(|s| s.driver.as_ref()) else {
            return format!("no progress for {} s", max_wait.as_secs());
        };
        let step = d.awaiting;
        let secs = max_wait.as_secs();
        match d.lost_at {
            _ if n == 1 => format!("no progress for {secs} s at step {step}: stage 0 does not answer"),
            Some(k) => format!(
                "no progress for {secs} s at step {step}: stage {k} lost the session and the ring has not answered \
                 since ({} re-drives)",
                d.redrives
            ),
            None => format!(
                "no progress for {secs} s at step {step}: no answer from stages 1-{} (one is down, unreachable or \
                 stuck; {} re-drives)",
                n - 1,
                d.redrives
            ),
        }
    }

    fn prompt_steps(&self, session: u64) -> u32 {
        self.sessions.get(&session).and_then(|s| s.driver.as_ref()).map_or(0, |d| d.prompt_steps)
    }

    /// A Lost frame reached the coordinator: replay, unless it is about an epoch that is
    /// already being replayed or re-driven (one loss makes one Lost per step in flight).
    fn on_lost(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        let Some(s) = self.sessions.get_mut(&f.session) else { return };
        if f.epoch < s.epoch {
            self.counters.stale_dropped += 1;
            return;
        }
        let stage = std::str::from_utf8(&f.payload).ok().and_then(|t| t.parse::<usize>().ok());
        if let Some(d) = s.driver.as_mut() {
            d.lost_at = stage.or(d.lost_at);
            d.replaying_for = stage;
            // The ring answered: the replay goes out with no backoff.
            d.backoff = 0;
        }
        self.replay(f.session, now, out);
    }

    /// A stage lost the session's positions: replay everything from position 0, unless
    /// it has been replayed `max_replays` times in a row without a new token.
    fn replay(&mut self, session: u64, now: Instant, out: &mut Vec<Action>) {
        let max_replays = self.cfg.retry.max_replays;
        let Some(s) = self.sessions.get_mut(&session) else { return };
        let Some(d) = s.driver.as_mut() else { return };
        if d.replays_in_row >= max_replays {
            let who = d.lost_at.map_or("a stage".to_string(), |k| format!("stage {k}"));
            let message = format!(
                "{who} keeps losing the session: {} replays in a row without a new token (is it restarting?)",
                d.replays_in_row
            );
            self.counters.gave_up += 1;
            return self.fail(session, message, out);
        }
        d.replays_in_row += 1;
        if d.closing {
            // The tail lost the session after the last token (so its digest too):
            // replay up to the last step, then close again.
            d.closing = false;
            d.replaying_finished = true;
        }
        s.epoch += 1;
        d.replays += 1;
        self.counters.replays += 1;
        tracing::info!(
            session,
            epoch = s.epoch,
            steps = d.awaiting + 1,
            "a stage lost the session; replaying from position 0"
        );
        self.open_and_send(session, 0, now, out);
    }

    // ---- every stage ----------------------------------------------------------------

    fn on_frame(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        match f.kind {
            FrameKind::Open => self.on_open(f, now, out),
            FrameKind::Hidden => self.on_hidden(f, now, out),
            FrameKind::Token if self.is_coordinator() => self.on_token(f, now, out),
            FrameKind::Close if self.is_coordinator() => self.finish(f, now, out),
            FrameKind::Close if self.is_tail() => {
                let ack = self.tail_close(f, out);
                out.push(Action::Send(ack));
            }
            FrameKind::Close => {
                if self.sessions.remove(&f.session).is_some() {
                    out.push(Action::Free(f.session));
                }
                out.push(Action::Send(f));
            }
            FrameKind::Lost if self.is_coordinator() => self.on_lost(f, now, out),
            FrameKind::Error if self.is_coordinator() => {
                let m = String::from_utf8_lossy(&f.payload).into_owned();
                self.fail(f.session, m, out);
            }
            // Token, Lost and Error frames travel on to the coordinator.
            FrameKind::Token | FrameKind::Lost | FrameKind::Error => out.push(Action::Send(f)),
        }
    }

    fn on_open(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        if self.is_coordinator() {
            return; // Opens start here; one that comes round the ring is spent.
        }
        let params: serde_json::Value = match serde_json::from_slice(&f.payload) {
            Ok(v) => v,
            Err(e) => {
                return self.send_to_coordinator(error_frame(&f, format!("bad session parameters: {e}")), now, out)
            }
        };
        self.adopt_incarnation(incarnation_of(f.session), out);
        let current = self.sessions.get(&f.session).map(|s| s.epoch);
        if current.is_some_and(|e| f.epoch < e) {
            self.counters.stale_dropped += 1;
            return;
        }
        if self.is_tail() {
            self.open_tail(f.session, f.epoch, &f.payload, now, out);
        } else {
            let s = self.sessions.entry(f.session).or_insert(Session {
                epoch: f.epoch,
                last_step: None,
                submitted: None,
                params,
                cache: ReplayCache::default(),
                tail: None,
                driver: None,
            });
            if f.epoch > s.epoch || current.is_none() {
                s.epoch = f.epoch;
                s.last_step = None;
            }
            out.push(Action::Send(f));
        }
    }

    /// Stages: an Open from a newer coordinator incarnation means the coordinator
    /// restarted, and nobody drives the sessions of the older ones any more: free them
    /// now, so their slots serve the new coordinator at once. An Open from an older
    /// incarnation (a coordinator whose clock stepped back) changes nothing; the idle
    /// expiry frees what is left then.
    fn adopt_incarnation(&mut self, incarnation: u64, out: &mut Vec<Action>) {
        if self.newest_incarnation.is_some_and(|n| n == incarnation || !is_newer(incarnation, n)) {
            return;
        }
        let restarted = self.newest_incarnation.replace(incarnation).is_some();
        if restarted && self.is_tail() {
            out.push(Action::RenewLink);
        }
        let orphans: Vec<u64> = self.sessions.keys().copied().filter(|&id| incarnation_of(id) != incarnation).collect();
        if orphans.is_empty() {
            return;
        }
        tracing::info!(
            freed = orphans.len(),
            incarnation,
            "the coordinator restarted: freed the sessions of its previous incarnation"
        );
        for id in orphans {
            self.sessions.remove(&id);
            self.last_seen.remove(&id);
            self.counters.orphans_freed += 1;
            out.push(Action::Free(id));
        }
    }

    fn open_tail(&mut self, session: u64, epoch: u32, params: &[u8], now: Instant, out: &mut Vec<Action>) {
        if let Some(s) = self.sessions.get_mut(&session) {
            if epoch >= s.epoch {
                s.epoch = epoch;
                s.last_step = None;
            }
            if s.tail.is_some() {
                // Keep the sampler and its tokens across epochs: a re-drive is not a restart.
                return;
            }
        }
        // The coordinator checked the parameters, but they arrive here from the network:
        // check them again before the factory makes a sampler of them.
        let value: Result<serde_json::Value, String> = serde_json::from_slice(params).map_err(|e| e.to_string());
        let checked = value.and_then(|v| crate::protocol::sampling_params(&v).map(|p| (v, p.logprobs)));
        match checked.and_then(|(v, logprobs)| (self.cfg.samplers)(&v).map(|s| (v, s, logprobs))) {
            Ok((v, sampler, logprobs)) => {
                let s = self.sessions.entry(session).or_insert(Session {
                    epoch,
                    last_step: None,
                    submitted: None,
                    params: v,
                    cache: ReplayCache::default(),
                    tail: None,
                    driver: None,
                });
                s.tail = Some(TailState {
                    sampler,
                    digest: LogitsDigest::default(),
                    sampled: HashMap::new(),
                    logprobs: logprobs.map(|n| n as usize),
                });
                // A fresh sampler and digest must see every step again: answers kept
                // for the tail state that went (a one-stage ring's coordinator keeps
                // its session past the Close) name tokens it no longer has.
                s.cache.steps.clear();
                s.cache.bytes = 0;
            }
            Err(e) => {
                let f = Frame::message(
                    FrameKind::Error,
                    session,
                    0,
                    epoch,
                    format!("bad sampling parameters: {e}").into_bytes(),
                );
                self.send_to_coordinator(f, now, out);
            }
        }
    }

    fn on_hidden(&mut self, f: Frame, now: Instant, out: &mut Vec<Action>) {
        let Some(s) = self.sessions.get_mut(&f.session) else {
            // Restarted, or the Open was lost with a broken connection.
            self.counters.lost_reported += 1;
            return self.send_to_coordinator(self.lost_frame(f.session, f.step, f.epoch), now, out);
        };
        if f.epoch < s.epoch {
            self.counters.stale_dropped += 1;
            return;
        }
        if f.epoch > s.epoch {
            // Its Open was lost; the frame itself says the epoch moved on.
            s.epoch = f.epoch;
            s.last_step = None;
        }
        if s.last_step.is_some_and(|l| f.step <= l) {
            self.counters.duplicates_dropped += 1;
            return;
        }
        if s.submitted.is_some_and(|l| f.step > l + 1) {
            self.counters.lost_reported += 1;
            return self.send_to_coordinator(self.lost_frame(f.session, f.step, f.epoch), now, out);
        }
        s.last_step = Some(f.step);
        let job = Job {
            session: f.session,
            epoch: f.epoch,
            step: f.step,
            first_pos: f.first_pos,
            flags: f.flags,
            input: JobInput::Hidden(Vec::new()),
            step_tokens: f.step_tokens(),
        };
        // Decoded only when the stage computes (a replay mostly does not).
        let n = f.n_tokens;
        s.submitted = Some(f.step);
        if let Some(answer) = s.cache.answer(f.step, f.first_pos, n).cloned() {
            self.counters.replay_skipped += 1;
            return self.send_answer(&job, n, answer, now, out);
        }
        s.cache.computed = Some(f.step);
        out.push(Action::Submit(Job { input: JobInput::Hidden(f.hidden_values()), ..job }));
    }

    fn on_done(&mut self, job: Job, result: Result<StepOutput, String>, now: Instant, out: &mut Vec<Action>) {
        if matches!(result, Ok(StepOutput::Gap) | Err(_)) {
            // The stage's positions are not what the replay cache assumes (an error may
            // have left them half-written): recompute everything from now on.
            if let Some(s) = self.sessions.get_mut(&job.session) {
                s.cache.lost();
            }
        }
        let Some(current) = self.sessions.get(&job.session).map(|s| s.epoch) else {
            // Finished for a session that is gone: nothing to pass on.
            self.counters.stale_dropped += 1;
            return;
        };
        if job.epoch < current {
            // Finished for an epoch that is gone: nothing is sent, but the answer is
            // right (a step's output depends on its inputs alone), so it is kept and
            // the tail samples it. The tail must: the new epoch's steps come after this
            // one's jobs (the stage runs a session's jobs in order), and the digest takes
            // every step once, in step order.
            self.counters.stale_dropped += 1;
            if let Ok(output) = result {
                self.keep_stale(&job, output);
            }
            return;
        }
        if matches!(result, Ok(StepOutput::Hidden(_) | StepOutput::Logits(_))) {
            if let Some(d) = self.sessions.get_mut(&job.session).and_then(|s| s.driver.as_mut()) {
                // The coordinator's own stage got further than ever (a prompt chunk on
                // its first pass): progress, while the rest of the ring catches up.
                if d.head_done.is_none_or(|h| job.step > h) {
                    d.head_done = Some(job.step);
                    d.progress_at = now;
                }
            }
        }
        match result {
            Err(e) => {
                let f = Frame::message(
                    FrameKind::Error,
                    job.session,
                    job.step,
                    job.epoch,
                    format!("stage {}: {e}", self.cfg.index).into_bytes(),
                );
                self.send_to_coordinator(f, now, out);
            }
            Ok(StepOutput::Gap) => {
                self.counters.lost_reported += 1;
                let f = self.lost_frame(job.session, job.step, job.epoch);
                self.send_to_coordinator(f, now, out);
            }
            Ok(StepOutput::Hidden(h)) => {
                let mut f =
                    Frame::hidden(job.session, job.step, job.epoch, job.first_pos, &h, self.cfg.n_embd, self.cfg.dtype);
                f.flags = job.flags & !FLAG_VERIFY;
                if job.flags & FLAG_VERIFY != 0 {
                    if job.step_tokens.len() as u32 != f.n_tokens {
                        let m = format!("stage {}: a verify step's tokens do not match its positions", self.cfg.index);
                        let e = Frame::message(FrameKind::Error, job.session, job.step, job.epoch, m.into_bytes());
                        return self.send_to_coordinator(e, now, out);
                    }
                    f = f.with_step_tokens(&job.step_tokens);
                }
                if let Some(s) = self.sessions.get_mut(&job.session) {
                    s.cache.keep(job.step, job.first_pos, f.n_tokens, Answer::Hidden(f.clone()));
                }
                out.push(Action::Send(f));
            }
            Ok(StepOutput::Logits(logits)) => {
                let n = job.input.n_tokens(self.cfg.n_embd);
                if job.flags & FLAG_SAMPLE == 0 {
                    if let Some(s) = self.sessions.get_mut(&job.session) {
                        s.cache.keep(job.step, job.first_pos, n, Answer::Quiet);
                    }
                    return;
                }
                let Some(s) = self.sessions.get_mut(&job.session) else { return };
                let Some(tail) = s.tail.as_mut() else {
                    self.counters.lost_reported += 1;
                    let f = self.lost_frame(job.session, job.step, job.epoch);
                    return self.send_to_coordinator(f, now, out);
                };
                let (tokens, lp) = match sample(tail, &job, &logits) {
                    Ok((t, resent)) => {
                        self.counters.cached_tokens_resent += u64::from(resent);
                        t
                    }
                    Err(e) => {
                        let m = format!("stage {}: {e}", self.cfg.index);
                        let f = Frame::message(FrameKind::Error, job.session, job.step, job.epoch, m.into_bytes());
                        return self.send_to_coordinator(f, now, out);
                    }
                };
                s.cache.keep(job.step, job.first_pos, n, Answer::Sampled);
                let f = token_frame(&job, job.first_pos + n, &tokens, &lp);
                self.send_to_coordinator(f, now, out);
            }
        }
    }

    /// Keep the answer of a job that finished for an epoch that is gone (see `on_done`).
    fn keep_stale(&mut self, job: &Job, output: StepOutput) {
        let n = job.input.n_tokens(self.cfg.n_embd);
        let (n_embd, dtype) = (self.cfg.n_embd, self.cfg.dtype);
        let Some(s) = self.sessions.get_mut(&job.session) else { return };
        match output {
            StepOutput::Gap => {}
            StepOutput::Hidden(h) => {
                let mut f = Frame::hidden(job.session, job.step, job.epoch, job.first_pos, &h, n_embd, dtype);
                f.flags = job.flags & !FLAG_VERIFY;
                if job.flags & FLAG_VERIFY != 0 {
                    if job.step_tokens.len() as u32 != f.n_tokens {
                        return;
                    }
                    f = f.with_step_tokens(&job.step_tokens);
                }
                s.cache.keep(job.step, job.first_pos, f.n_tokens, Answer::Hidden(f));
            }
            StepOutput::Logits(_) if job.flags & FLAG_SAMPLE == 0 => {
                s.cache.keep(job.step, job.first_pos, n, Answer::Quiet)
            }
            StepOutput::Logits(logits) => {
                let Some(tail) = s.tail.as_mut() else { return };
                // A verify step that does not check out is refused when the current
                // epoch's run of it finishes.
                if sample(tail, job, &logits).is_ok() {
                    s.cache.keep(job.step, job.first_pos, n, Answer::Sampled);
                }
            }
        }
    }

    /// Tail: free the session and answer with its digest (remembered for a repeat).
    fn tail_close(&mut self, f: Frame, out: &mut Vec<Action>) -> Frame {
        let digest = match self.sessions.get_mut(&f.session).and_then(|s| s.tail.take()) {
            Some(t) => {
                let d = t.digest.hex();
                self.closed.push_back((f.session, d.clone()));
                if self.closed.len() > 256 {
                    self.closed.pop_front();
                }
                d
            }
            None => match self.closed.iter().find(|(s, _)| *s == f.session) {
                Some((_, d)) => d.clone(),
                // Restarted since: the digest is gone, and only a replay can rebuild it.
                None => {
                    self.counters.lost_reported += 1;
                    return self.lost_frame(f.session, f.step, f.epoch);
                }
            },
        };
        if !self.is_coordinator() && self.sessions.remove(&f.session).is_some() {
            out.push(Action::Free(f.session));
        }
        Frame::message(FrameKind::Close, f.session, f.step, f.epoch, digest.into_bytes())
    }
}

impl NodeCore {
    /// "This stage lacks the positions before `step`", signed with the stage's index so
    /// the coordinator can name a stage that keeps losing sessions.
    fn lost_frame(&self, session: u64, step: u32, epoch: u32) -> Frame {
        Frame::message(FrameKind::Lost, session, step, epoch, self.cfg.index.to_string().into_bytes())
    }
}

/// The tail's tokens for `job`'s step from its `logits`: sampled (and the logits
/// digested) the first time, the same tokens again after that (`true`: a repeat).
fn sample(tail: &mut TailState, job: &Job, logits: &[f32]) -> Result<(Sampled, bool), String> {
    if let Some(t) = tail.sampled.get(&job.step) {
        return Ok((t.clone(), true));
    }
    let answer = if job.flags & FLAG_VERIFY != 0 {
        let t = speculative::verify(tail.sampler.as_mut(), logits, &job.step_tokens, &mut tail.digest)
            .map_err(|e| e.to_string())?;
        (t, None)
    } else {
        tail.digest.update(logits);
        let t = tail.sampler.sample(logits);
        // The model's distribution (the sampler reshapes its own copy).
        let lp = tail.logprobs.map(|n| TokenLogprobs::of(logits, t, n));
        (vec![t], lp)
    };
    tail.sampled.insert(job.step, answer.clone());
    Ok((answer, false))
}

/// The tail's answer to `job`: its tokens (with log-probabilities, for a one-token step
/// that asked for them), the next position after the step.
fn token_frame(job: &Job, next_pos: u32, tokens: &[TokenId], lp: &Option<TokenLogprobs>) -> Frame {
    match (lp, tokens) {
        (Some(lp), [token]) => Frame::token_with_logprobs(job.session, job.step, job.epoch, next_pos, *token, lp),
        _ => Frame::tokens(job.session, job.step, job.epoch, next_pos, tokens),
    }
}

fn error_frame(f: &Frame, message: String) -> Frame {
    Frame::message(FrameKind::Error, f.session, f.step, f.epoch, message.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct First;
    impl TokenSampler for First {
        fn sample(&mut self, _: &[f32]) -> TokenId {
            0
        }
    }

    fn core(index: usize) -> NodeCore {
        let samplers: SamplerFactory = Arc::new(|_: &serde_json::Value| Ok(Box::new(First) as Box<dyn TokenSampler>));
        let cfg = CoreConfig {
            index,
            n_stages: 3,
            chunk: 4,
            n_ctx: 64,
            n_embd: 2,
            dtype: Dtype::F32,
            samplers,
            retry: RetryPolicy::default(),
            drafts: None,
        };
        NodeCore::new(cfg, 0)
    }

    #[test]
    fn incarnations_compare_across_the_wrap() {
        assert!(is_newer(2, 1) && !is_newer(1, 2) && !is_newer(5, 5));
        let last = (1u64 << INCARNATION_BITS) - 1;
        assert!(is_newer(0, last) && !is_newer(last, 0));
        assert_eq!(incarnation_of(session_id(123, 45)), 123);
        // The counter cannot spill into the incarnation.
        assert_eq!(session_id(7, 1 << SESSION_COUNTER_BITS | 3), session_id(7, 3));
    }

    #[test]
    fn abandoned_sessions_are_freed_on_stages() {
        let t0 = Instant::now();
        let mut c = core(1);
        let open = Frame::message(FrameKind::Open, 7, 0, 0, b"{}".to_vec());
        let out = c.handle(Input::Frame(open), t0);
        assert!(matches!(out.as_slice(), [Action::Send(_)]));
        assert_eq!(c.session_count(), 1);
        assert!(c.handle(Input::Tick, t0 + Duration::from_secs(60)).is_empty());
        assert_eq!(c.session_count(), 1);
        let out = c.handle(Input::Tick, t0 + Duration::from_secs(121));
        assert!(matches!(out.as_slice(), [Action::Free(7)]), "{out:?}");
        assert_eq!(c.session_count(), 0);
    }

    /// A sampler factory that counts the samplers it makes (none must be made for a
    /// refused request).
    fn counting_core(index: usize) -> (NodeCore, Arc<std::sync::atomic::AtomicUsize>) {
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = made.clone();
        let samplers: SamplerFactory = Arc::new(move |_: &serde_json::Value| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Box::new(First) as Box<dyn TokenSampler>)
        });
        let mut c = core(index);
        c.cfg.samplers = samplers;
        (c, made)
    }

    fn request(prompt_len: usize, max_new: u32, sampling: serde_json::Value) -> GenerateRequest {
        GenerateRequest {
            prompt: vec![1; prompt_len],
            max_new,
            stop: vec![],
            sampling,
            resume: vec![],
            speculative: None,
            tag: None,
        }
    }

    /// The coordinator's answer to a request it refuses: one error to the client, and
    /// nothing sent to any stage.
    fn refusal(c: &mut NodeCore, req: GenerateRequest) -> String {
        let out = c.handle(Input::Generate(req, 5), Instant::now());
        assert_eq!(c.session_count(), 0);
        match out.as_slice() {
            [Action::Reply(5, GenEvent::Error(m))] => m.clone(),
            other => panic!("expected one refusal, got {other:?}"),
        }
    }

    #[test]
    fn huge_repeat_last_n_is_refused_at_the_coordinator() {
        let (mut c, made) = counting_core(0);
        let m = refusal(&mut c, request(4, 8, serde_json::json!({"repeat_last_n": i32::MAX, "repeat_penalty": 1.1})));
        assert!(m.contains("repeat_last_n 2147483647 is outside 0 (off) ..= 65536"), "{m}");
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[test]
    fn out_of_range_sampling_parameters_are_refused_at_the_coordinator() {
        let (mut c, _) = counting_core(0);
        for (sampling, says) in [
            (serde_json::json!({"top_k": -3}), "top_k -3"),
            (serde_json::json!({"top_p": 1.5}), "top_p 1.5"),
            (serde_json::json!({"min_p": -0.5}), "min_p -0.5"),
            (serde_json::json!({"temperature": -1.0}), "temperature -1"),
            (serde_json::json!({"temperature": 1e39}), "temperature inf"),
            (serde_json::json!({"repeat_penalty": 0.0}), "repeat_penalty 0"),
            (serde_json::json!({"repeat_last_n": -1}), "repeat_last_n -1"),
            (serde_json::json!({"mirostat": 2}), "unknown field `mirostat`"),
            (serde_json::json!("greedy"), "bad sampling parameters"),
        ] {
            let m = refusal(&mut c, request(4, 8, sampling.clone()));
            assert!(m.starts_with("bad sampling parameters: ") && m.contains(says), "{sampling}: {m}");
        }
    }

    #[test]
    fn zero_max_tokens_and_answers_over_the_context_are_refused_at_the_coordinator() {
        let (mut c, _) = counting_core(0);
        assert!(refusal(&mut c, request(4, 0, serde_json::json!({}))).contains("max_tokens is 0"));
        assert!(refusal(&mut c, request(0, 4, serde_json::json!({}))).contains("empty prompt"));
        let m = refusal(&mut c, request(60, u32::MAX, serde_json::json!({})));
        assert!(m.contains("at most 4 new tokens fit"), "{m}");
        let m = refusal(&mut c, request(64, 1, serde_json::json!({})));
        assert!(m.contains("the prompt of 64 tokens exceeds the context of 64"), "{m}");
        // Within bounds, the session starts.
        let out =
            c.handle(Input::Generate(request(60, 4, serde_json::json!({"repeat_last_n": 65536})), 5), Instant::now());
        assert!(matches!(out.as_slice(), [Action::Send(_), ..]), "{out:?}");
        assert_eq!(c.session_count(), 1);
    }

    #[test]
    fn huge_repeat_last_n_in_an_open_frame_is_refused_by_the_tail() {
        // The tail (index 2 of 3) gets the parameters from the network, not from the
        // coordinator's check: it refuses them itself, and makes no sampler.
        let (mut c, made) = counting_core(2);
        let params = serde_json::to_vec(&serde_json::json!({"repeat_last_n": i32::MAX})).unwrap();
        let out = c.handle(Input::Frame(Frame::message(FrameKind::Open, 9, 0, 0, params)), Instant::now());
        match out.as_slice() {
            [Action::Send(f)] if f.kind == FrameKind::Error => {
                let m = String::from_utf8_lossy(&f.payload);
                assert!(m.contains("bad sampling parameters: repeat_last_n 2147483647"), "{m}");
            }
            other => panic!("expected an error frame to the coordinator, got {other:?}"),
        }
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(c.session_count(), 0);
        // Sane parameters still open the session.
        let out = c.handle(Input::Frame(Frame::message(FrameKind::Open, 10, 0, 0, b"{}".to_vec())), Instant::now());
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
