//! The async shell around [`NodeCore`](crate::core::NodeCore): it owns the sockets,
//! the stage thread and the clock, feeds the core one input at a time and carries out
//! the actions it returns. The stage computes on its own thread so the network keeps
//! flowing while it works (prefill chunks overlap across stages).

use crate::breakdown::{DecodeTimes, Mean, Timing};
pub use crate::core::SamplerFactory;
use crate::core::{Action, ClientId, CoreConfig, Input, Job, JobInput, NodeCore, Prepared, RetryPolicy, StepOutput};
use crate::placement::Placement;
use crate::protocol::{ControlRequest, GenEvent, GenerateRequest, NodeStatus, MAX_REQUEST};
use crate::PipelineError;
use shoal_net::frame::HEADER_LEN;
use shoal_net::{alpn, Dtype, Frame, FrameKind, FrameLimits, Incoming, Node, NodeId, Router};
use shoal_types::{SessionId, Stage, StageError, StageInput, StageOutput};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

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
    /// Re-drive and give-up timing.
    pub retry: RetryPolicy,
    /// Keep-alive: for this long after the last frame or finished step (a session is
    /// generating), the node's thread does not sleep between tokens; it spins, so the
    /// next frame is handled (and, inline, computed) without a wake-up. `None`: it
    /// sleeps. Costs a core while on. See [`KEEPALIVE_WINDOW`].
    pub keepalive: Option<Duration>,
    /// A draft model for the generations this node coordinates (stage 0 only; see
    /// [`crate::core::CoreConfig::drafts`]).
    pub drafts: Option<Arc<dyn shoal_types::speculative::DraftSource>>,
    /// Where a node of the ring is now, asked at each (re)connection: a cluster node
    /// follows its membership, which moves a member to a new address (DHCP renumbered
    /// it) once the member proved its key there. `None`, or no answer: the placement's
    /// address.
    pub addresses: Option<Addresses>,
}

/// Where a node is now (see [`ServiceConfig::addresses`]).
pub type Addresses = Arc<dyn Fn(NodeId) -> Option<std::net::SocketAddr> + Send + Sync>;

/// How long one connection attempt to the next node may take: a LAN handshake takes
/// milliseconds, one that lost its first packets two retries (0.3 and 0.9 s: see the
/// endpoint's initial RTT); an attempt made while the link was down, or to an address
/// nobody answers at any more (the node was renumbered), would otherwise wait out its
/// backed-off retries (the next at 2.1 s) or QUIC's idle timeout before a fresh one
/// goes out, so the link would come up seconds after the network did.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1200);

/// Keep-alive window when it is on: longer than a token's trip round a home pipeline
/// (so it holds between tokens of a generation), short enough that a node stops
/// spinning soon after its sessions stop.
pub const KEEPALIVE_WINDOW: Duration = Duration::from_millis(250);

/// Largest Open/Close/Error payload.
const MAX_MESSAGE: u32 = 64 << 10;
/// How often the core's clock ticks (re-drive checks).
const TICK: Duration = Duration::from_millis(50);

/// Work for the stage thread.
enum Work {
    Forward(Queued),
    Free(u64),
}

/// A job handed to the stage thread, with what its timing is counted as.
struct Queued {
    job: Job,
    /// When it was handed over.
    at: Instant,
    /// A one-token decode step (the node's profile counts its round trip).
    decode: bool,
    /// Any decode step, a verify step too (the breakdown's round trip; and the stage
    /// thread runs it before other sessions' prompt chunks: [`next_job`]).
    step: bool,
}

/// How many decode steps of other sessions may go before the oldest queued job (a
/// prompt chunk) in a row: a long prompt then never stalls other sessions' streams
/// for more than one chunk's compute, and is never starved by them.
const STEPS_BEFORE_CHUNK: u32 = 8;

/// Everything the shell feeds the core, plus client registration.
enum Event {
    Input(Input),
    /// A frame from the previous stage, and when its reader task had it decoded.
    Frame(Frame, Instant),
    /// A generation, with its start computed off the loop where a draft model does it.
    Generate(GenerateRequest, Client, Option<Prepared>),
    /// The stage thread ran a job.
    Ran(Queued, Result<StepOutput, String>),
    Status(tokio::sync::oneshot::Sender<NodeStatus>),
    /// This node (authenticated as the key) has just started ([`ControlRequest::Started`]).
    Started(NodeId),
    /// The previous stage connected again after its link's connection closed.
    LinkRenewed,
}

/// What a control task needs to compute a generation's start ([`Prepared::new`]) on a
/// blocking thread: a draft model reads the prompt there (and replays a resumed
/// generation's drafts), not in the event loop every session's frames go through.
struct Starts {
    drafts: Option<Arc<dyn shoal_types::speculative::DraftSource>>,
    n_ctx: u32,
    chunk: u32,
    /// The tagged generations running here, so that a resumption ends its old attempt.
    running: Running,
}

/// Tagged generations running at this coordinator, by client node and tag
/// ([`GenerateRequest::tag`]): a serial (which registration) and what tells it to end.
#[derive(Default)]
struct Running(std::sync::Mutex<HashMap<(NodeId, u64), Registration>>);

/// One tagged generation's entry in [`Running`]: its serial, and what ends it.
type Registration = (u64, Arc<tokio::sync::Notify>);

impl Running {
    /// Register the generation `key`; one still running under the same key is told to
    /// end (its client has given up on it and resumes with this one).
    fn enter(&self, key: (NodeId, u64)) -> Entered<'_> {
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let end = Arc::new(tokio::sync::Notify::new());
        // A panic elsewhere while holding the lock leaves a map that is still whole.
        let mut map = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, old)) = map.insert(key, (serial, end.clone())) {
            // Stored if the old one is not waiting right now: it ends when it looks.
            old.notify_one();
        }
        Entered { running: self, key, serial, end }
    }
}

/// A registration in [`Running`], removed when dropped (unless a newer one took the key).
struct Entered<'a> {
    running: &'a Running,
    key: (NodeId, u64),
    serial: u64,
    /// Notified when a resumption of the same generation arrived.
    end: Arc<tokio::sync::Notify>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut map = self.running.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.get(&self.key).is_some_and(|(serial, _)| *serial == self.serial) {
            map.remove(&self.key);
        }
    }
}

/// A control client waiting for its generation's events, as the event loop holds it.
struct Client {
    /// Its events, to the task that writes them to its stream. Bounded, and only ever
    /// `try_send`: the event loop never waits for a client.
    events: mpsc::Sender<GenEvent>,
    /// Sending on it makes that task reset the stream (the client is cut off).
    cut: tokio::sync::oneshot::Sender<()>,
}

/// Events queued per control client. A client that lets this many pile up (its stream
/// is full: it does not read) is disconnected and its generation cancelled. A reading
/// client's writer drains its queue whenever the event loop waits or yields: the loop
/// yields after a turn that left a queue half full, and a turn adds at most
/// [`INLINE_BUDGET`] + 1 events to a queue, so a client that reads never gets near this.
const CLIENT_QUEUE: usize = 128;

/// Decode steps run inline per turn of the event loop. In a one-stage ring a whole
/// generation could otherwise run inside one turn, starving the clients' writers (and
/// every other task on the thread); past this, steps go to the stage thread and the
/// loop waits for them like for any other event.
const INLINE_BUDGET: u32 = 16;

/// Counters kept outside the core (by the link and reader tasks).
#[derive(Default)]
struct ShellCounters {
    /// Single-token forwards (decode steps) the stage computed, and their total time:
    /// the node's measured decode cost, for the planner's profiles.
    decode_steps: std::sync::atomic::AtomicU64,
    decode_ns: std::sync::atomic::AtomicU64,
    /// From handing decode steps to the stage thread to handling their result: compute
    /// plus the two thread hand-offs.
    decode_roundtrip_ns: std::sync::atomic::AtomicU64,
    link_connects: std::sync::atomic::AtomicU64,
    malformed_frames: std::sync::atomic::AtomicU64,
    refused_by_next: std::sync::atomic::AtomicU64,
    /// Whether the stage before this one and the coordinator have taken in this stage's
    /// start ([`announce_start`]); set from the start at the coordinator, which has
    /// nobody to tell.
    start_announced: std::sync::atomic::AtomicBool,
    /// Frees handed to the stage thread and not yet done: a decode step runs inline only
    /// when none is pending, so a slot freed for it is free when it runs.
    frees_pending: std::sync::atomic::AtomicUsize,
    /// Where decode steps' time goes on this node (`NodeStatus::decode_times`).
    steps: StepClocks,
}

/// The running means behind [`DecodeTimes`], written by whichever task or thread sees
/// each part of a step (event loop, stage thread, link task, client writers).
#[derive(Default)]
struct StepClocks {
    compute: Mean,
    /// The same forwards' time on a core (the thread's CPU time).
    compute_cpu: Mean,
    /// Handing a step to the stage (thread, or inline) to handling its result.
    roundtrip: Mean,
    core_in: Mean,
    core_out: Mean,
    receive_wait: Mean,
    hop_in: Mean,
    send_wait: Mean,
    write: Mean,
    interval: Mean,
    client_write: Mean,
}

impl StepClocks {
    fn times(&self) -> DecodeTimes {
        let (compute, roundtrip) = (self.compute.timing(), self.roundtrip.timing());
        DecodeTimes {
            compute,
            compute_cpu: self.compute_cpu.timing(),
            handoff: Timing {
                n: roundtrip.n,
                mean_us: (roundtrip.mean_us - compute.mean_us).max(0.0),
                p50_us: (roundtrip.p50_us - compute.p50_us).max(0.0),
            },
            core_in: self.core_in.timing(),
            core_out: self.core_out.timing(),
            receive_wait: self.receive_wait.timing(),
            hop_in: self.hop_in.timing(),
            send_wait: self.send_wait.timing(),
            write: self.write.timing(),
            interval: self.interval.timing(),
            client_write: self.client_write.timing(),
        }
    }
}

/// Serve `cfg`'s stage on `node` until the endpoint closes.
pub async fn serve(node: Arc<Node>, cfg: ServiceConfig) -> Result<(), PipelineError> {
    let router = Router::new(node.clone());
    serve_on(node, &router, cfg).await
}

/// [`serve`] on an endpoint shared with other services: the stage takes the pipeline
/// and control connections from `router`. Dropping the returned future stops the
/// stage (its tasks end as their channels close); the endpoint stays open.
pub async fn serve_on(node: Arc<Node>, router: &Router, cfg: ServiceConfig) -> Result<(), PipelineError> {
    let ServiceConfig { placement, index, stage, samplers, dtype, retry, keepalive, drafts, addresses } = cfg;
    let info = stage.info().clone();
    let limits = FrameLimits { n_embd: info.n_embd, max_tokens: info.chunk, max_message: MAX_MESSAGE };
    let (events_tx, mut events) = mpsc::channel::<Event>(1024);

    let (work_tx, work_rx) = std::sync::mpsc::channel::<Work>();
    let done_tx = events_tx.clone();
    let shell = Arc::new(ShellCounters::default());
    let stats = shell.clone();
    let stage = Arc::new(Mutex::new(stage));
    let threads_stage = stage.clone();
    std::thread::Builder::new()
        .name(format!("stage-{}", info.layers))
        .spawn(move || stage_thread(threads_stage, work_rx, done_tx, &stats))
        .map_err(|e| PipelineError::Stream(format!("cannot start the stage thread: {e}")))?;

    let next = placement.next(index).clone();
    let next_is_self = next.node == node.id();
    let (link_tx, link_rx) = mpsc::channel::<Link>(4096);
    if !next_is_self {
        tokio::spawn(link_task(node.clone(), next.clone(), addresses.clone(), link_rx, shell.clone()));
    }
    let n = placement.stages.len();
    let prev = placement.prev(index).node;
    let incoming = (router.route(alpn::PIPELINE), router.route(alpn::CONTROL));
    let admission = Arc::new(Admission::new(info.max_sessions as usize));
    let starts = Arc::new(Starts {
        drafts: drafts.clone(),
        n_ctx: info.n_ctx_per_session,
        chunk: info.chunk,
        running: Running::default(),
    });
    tokio::spawn(accept_task(incoming, prev, limits, events_tx.clone(), shell.clone(), admission.clone(), starts));
    if index != 0 {
        let (prev, coordinator) = (placement.prev(index).clone(), placement.stages[0].clone());
        tokio::spawn(announce_start(node.clone(), prev, coordinator, addresses.clone(), shell.clone()));
    } else {
        shell.start_announced.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let ring: Vec<NodeId> = placement.stages.iter().map(|s| s.node).collect();
    let coordinator = index == 0;
    let ticker = events_tx.clone();
    tokio::spawn(async move {
        let mut t = tokio::time::interval(TICK);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            t.tick().await;
            if ticker.send(Event::Input(Input::Tick)).await.is_err() {
                return;
            }
        }
    });

    let awake = keepalive.map(KeepAwake::start);

    let core_cfg = CoreConfig {
        index,
        n_stages: n,
        chunk: info.chunk,
        n_ctx: info.n_ctx_per_session,
        n_embd: info.n_embd,
        dtype,
        samplers,
        retry,
        drafts,
    };
    let mut core = NodeCore::new(core_cfg, incarnation_now());
    let mut clients: HashMap<ClientId, Client> = HashMap::new();
    let mut slow_clients_dropped = 0u64;
    let mut next_client: ClientId = 0;
    let mut hops = crate::latency::HopLatencies::default();
    // When each job still with the stage thread was handed over (it works in order), and
    // whether it is a one-token decode step / any decode step (a verify step too).
    let mut queued = 0usize;
    // Coordinator: when each session's last decode step started, for the step interval.
    let mut last_step: HashMap<u64, Instant> = HashMap::new();
    tracing::info!(stage = %info.layers, addr = ?node.local_addr().ok(), "serving");
    while let Some(ev) = events.recv().await {
        if let (Some(k), Event::Frame(..) | Event::Ran(..) | Event::Generate(..)) = (&awake, &ev) {
            k.touch();
        }
        // Generations whose clients' tasks have ended, cancelled before the next input.
        let mut gone: Vec<Input> = Vec::new();
        let input = match ev {
            Event::Frame(f, decoded) => {
                tracing::trace!(kind = ?f.kind, step = f.step, epoch = f.epoch, "frame in");
                hops.record(&f);
                if is_step_frame(&f) {
                    shell.steps.receive_wait.add(decoded.elapsed());
                    if let Some(age) = f.age_us() {
                        shell.steps.hop_in.add(Duration::from_micros(age.into()));
                    }
                }
                Input::Frame(f)
            }
            Event::Ran(q, out) => {
                queued = queued.saturating_sub(1);
                let took = q.at.elapsed();
                if q.decode {
                    shell.decode_roundtrip_ns.fetch_add(took.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                if q.step {
                    shell.steps.roundtrip.add(took);
                }
                Input::Done(q.job, out)
            }
            Event::Input(i) => i,
            Event::Generate(req, client, prepared) => {
                // A client whose task ended (its stream failed, or a resumption took
                // its place) is cancelled before this one starts, so its session's
                // Close goes round the ring ahead of this one's Open.
                clients.retain(|id, c| {
                    let closed = c.events.is_closed();
                    if closed {
                        gone.push(Input::Cancel(*id));
                    }
                    !closed
                });
                next_client += 1;
                clients.insert(next_client, client);
                match prepared {
                    Some(p) => Input::GeneratePrepared(req, next_client, p),
                    None => Input::Generate(req, next_client),
                }
            }
            Event::Status(reply) => {
                use std::sync::atomic::Ordering::Relaxed;
                let _ = reply.send(NodeStatus {
                    node: node.id().to_string(),
                    layers: info.layers,
                    sessions: core.session_count(),
                    waiting: admission.waiting.load(Relaxed),
                    counters: core.counters.clone(),
                    link_connects: shell.link_connects.load(Relaxed),
                    malformed_frames: shell.malformed_frames.load(Relaxed),
                    refused_by_next: shell.refused_by_next.load(Relaxed),
                    start_announced: shell.start_announced.load(Relaxed),
                    hop_in: hops.summary(),
                    decode_steps: shell.decode_steps.load(Relaxed),
                    decode_compute_ms: shell.decode_ns.load(Relaxed) as f64
                        / 1e6
                        / shell.decode_steps.load(Relaxed).max(1) as f64,
                    slow_clients_dropped,
                    keepalive: awake.is_some(),
                    keepalive_spinning: awake.as_ref().is_some_and(KeepAwake::spinning),
                    decode_handoff_ms: shell
                        .decode_roundtrip_ns
                        .load(Relaxed)
                        .saturating_sub(shell.decode_ns.load(Relaxed)) as f64
                        / 1e6
                        / shell.decode_steps.load(Relaxed).max(1) as f64,
                    decode_times: shell.steps.times(),
                });
                continue;
            }
            Event::Started(peer) => {
                // The next stage restarted: the link's connection is to its previous
                // life; a fresh one goes out before the re-drives below.
                if peer == next.node && !next_is_self {
                    tracing::info!(%peer, "the next stage has restarted; connecting again");
                    if link_tx.send(Link::Renew).await.is_err() {
                        tracing::error!("the link task has stopped");
                    }
                }
                let Some(k) = ring.iter().position(|n| *n == peer).filter(|_| coordinator) else { continue };
                tracing::info!(%peer, stage = k, "a stage has restarted; re-driving now");
                Input::StageStarted(k)
            }
            Event::LinkRenewed if coordinator => {
                tracing::info!("the ring's link into the coordinator is up again; re-driving now");
                Input::LinkRenewed
            }
            Event::LinkRenewed => continue,
        };
        // Last in, first handled: the cancellations go before the input.
        let mut pending = vec![input];
        pending.extend(gone);
        let mut inline_runs = 0u32;
        // A client's queue is half full: let its writer run before the next turn (with
        // a fast stage the next event is always ready and the loop would not wait).
        let mut let_writers_run = false;
        // A token went to a client's queue since the last inline compute: its writer
        // runs before the next one (see the inline branch).
        let mut replied = false;
        while let Some(input) = pending.pop() {
            let clock = match &input {
                Input::Frame(f) if is_step_frame(f) => Some(&shell.steps.core_in),
                Input::Done(job, _) if is_step(job, info.n_embd) => Some(&shell.steps.core_out),
                _ => None,
            };
            let t_core = Instant::now();
            let actions = core.handle(input, t_core);
            if let Some(clock) = clock {
                clock.add(t_core.elapsed());
            }
            for action in actions {
                match action {
                    Action::Send(f) if next_is_self => pending.push(Input::Frame(f)),
                    Action::Send(mut f) => {
                        tracing::trace!(kind = ?f.kind, step = f.step, epoch = f.epoch, "frame out");
                        f.sent_us = shoal_net::wall_us();
                        if link_tx.send(Link::Frame(f, Instant::now())).await.is_err() {
                            tracing::error!("the link task has stopped");
                        }
                    }
                    Action::Submit(job) => {
                        let step = is_step(&job, info.n_embd);
                        if coordinator && step {
                            let now = Instant::now();
                            if let Some(prev) = last_step.insert(job.session, now) {
                                shell.steps.interval.add(now - prev);
                            }
                        }
                        let decode = is_decode(&job, info.n_embd);
                        // A decode step while the stage thread has nothing queued runs
                        // right here: a few ms of compute on this thread cost less than
                        // waking the stage thread and being woken by it again (each
                        // wake-up is 0.1-0.5 ms on a loaded or virtual machine), and
                        // nothing else is due meanwhile (the pipeline is in lock-step for
                        // this session). With other sessions here it runs on the stage
                        // thread, which yields to this one (`lower_priority`), so their
                        // frames move on while it computes.
                        if queued == 0
                            && core.session_count() <= 1
                            && inline_runs < INLINE_BUDGET
                            && shell.frees_pending.load(std::sync::atomic::Ordering::Acquire) == 0
                            && decode
                        {
                            inline_runs += 1;
                            // The token this step follows goes to its client first: its
                            // writer would otherwise run only after the compute, and its
                            // client's process then wake just as this step's frame goes
                            // to the next stage, taking the CPU the next stage needs
                            // (~80 µs on the hop, measured); now the client gets its
                            // token a step's compute sooner too.
                            if std::mem::take(&mut replied) {
                                tokio::task::yield_now().await;
                            }
                            let t0 = Instant::now();
                            let out = match stage.lock() {
                                Ok(mut s) => run_job(s.as_mut(), &job, &shell),
                                Err(_) => Err("the stage panicked earlier; restart this node".to_string()),
                            };
                            let took = t0.elapsed();
                            shell
                                .decode_roundtrip_ns
                                .fetch_add(took.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
                            shell.steps.roundtrip.add(took);
                            pending.push(Input::Done(job, out));
                        } else {
                            queued += 1;
                            let _ = work_tx.send(Work::Forward(Queued { job, at: Instant::now(), decode, step }));
                        }
                    }
                    Action::RenewLink => {
                        if !next_is_self && link_tx.send(Link::Renew).await.is_err() {
                            tracing::error!("the link task has stopped");
                        }
                    }
                    Action::Free(s) => {
                        last_step.remove(&s);
                        shell.frees_pending.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                        if work_tx.send(Work::Free(s)).is_err() {
                            shell.frees_pending.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                        }
                    }
                    Action::Reply(id, ev) => {
                        let end = !ev.is_token();
                        let Some(client) = clients.get(&id) else { continue };
                        // Never wait here: one client that does not read would stall
                        // every other generation on this coordinator.
                        match client.events.try_send(ev) {
                            Ok(()) if end => {
                                clients.remove(&id);
                            }
                            Ok(()) => {
                                replied = true;
                                let_writers_run |= client.events.capacity() < CLIENT_QUEUE / 2;
                            }
                            Err(mpsc::error::TrySendError::Full(_)) => {
                                slow_clients_dropped += 1;
                                tracing::warn!(
                                    client = id,
                                    queued = CLIENT_QUEUE,
                                    "a control client does not read its events; disconnected, its generation \
                                     cancelled and its session freed"
                                );
                                if let Some(c) = clients.remove(&id) {
                                    let _ = c.cut.send(());
                                }
                                pending.push(Input::Cancel(id));
                            }
                            Err(mpsc::error::TrySendError::Closed(_)) => {
                                tracing::info!(client = id, "a control client went away; its generation cancelled");
                                clients.remove(&id);
                                if !end {
                                    pending.push(Input::Cancel(id));
                                }
                            }
                        }
                    }
                }
            }
        }
        if let_writers_run {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

/// Keeps the node's thread busy while sessions generate (keep-alive): a task that
/// yields to the runtime in a loop until the window after the last activity has passed,
/// then waits to be touched again. A yielding task makes the runtime poll its sockets
/// without blocking instead of sleeping in the kernel, so a frame that arrives is read
/// (and a decode step computed inline) at once, by a thread whose caches are warm. Each
/// turn also yields the CPU to the OS, so other runnable threads lose little to it
/// (the scheduler decides; Linux's moves the spinner behind them).
struct KeepAwake {
    /// When the last activity was, in ns since `epoch`.
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: Instant,
    /// Wakes the spinner after it stopped.
    wake: Arc<tokio::sync::Notify>,
    /// The spinner is spinning now (for the node's status).
    spinning: Arc<std::sync::atomic::AtomicBool>,
    /// The spinner task, stopped with the service.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KeepAwake {
    fn start(window: Duration) -> KeepAwake {
        let last = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let epoch = Instant::now();
        let wake = Arc::new(tokio::sync::Notify::new());
        let spinning = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = tokio::spawn({
            let (last, wake, spinning) = (last.clone(), wake.clone(), spinning.clone());
            async move {
                loop {
                    spinning.store(false, std::sync::atomic::Ordering::Relaxed);
                    wake.notified().await;
                    spinning.store(true, std::sync::atomic::Ordering::Relaxed);
                    loop {
                        let idle = epoch
                            .elapsed()
                            .saturating_sub(Duration::from_nanos(last.load(std::sync::atomic::Ordering::Relaxed)));
                        if idle >= window {
                            break;
                        }
                        // Politely: let any other runnable thread go first (the stage
                        // thread, another stage on the same machine).
                        std::thread::yield_now();
                        tokio::task::yield_now().await;
                    }
                }
            }
        });
        KeepAwake { last, epoch, wake, spinning, task }
    }

    /// Whether the node spins now.
    fn spinning(&self) -> bool {
        self.spinning.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Something happened: stay awake for another window.
    fn touch(&self) {
        self.last.store(self.epoch.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        // A permit is stored if the spinner is busy; it then checks once more and waits.
        self.wake.notify_one();
    }
}

/// The stage's own thread: runs queued jobs (prompt chunks, and decode steps that
/// arrive while it is busy), each session's in order, decode steps before other
/// sessions' prompt chunks ([`next_job`]).
fn stage_thread(
    stage: Arc<Mutex<Box<dyn Stage>>>,
    work: std::sync::mpsc::Receiver<Work>,
    done: mpsc::Sender<Event>,
    stats: &ShellCounters,
) {
    lower_priority();
    let mut queue = std::collections::VecDeque::new();
    // Decode steps that went before the oldest queued job.
    let mut passed = 0u32;
    loop {
        if queue.is_empty() {
            match work.recv() {
                Ok(w) => queue.push_back(w),
                Err(_) => return,
            }
        }
        queue.extend(work.try_iter());
        let i = next_job(&queue, passed);
        passed = if i == 0 { 0 } else { passed + 1 };
        // Invariant: `next_job` names a queued job, and the queue is not empty.
        let Some(w) = queue.remove(i) else { return };
        // A poisoned lock means a forward panicked; the stage may be inconsistent.
        let Ok(mut stage) = stage.lock() else { return };
        match w {
            Work::Free(s) => {
                stage.free_session(SessionId(s));
                stats.frees_pending.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
            Work::Forward(q) => {
                let out = run_job(stage.as_mut(), &q.job, stats);
                drop(stage);
                if done.blocking_send(Event::Ran(q, out)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Make this thread (the stage's compute) yield to the node's networking threads: where
/// the stages of a pipeline share a machine's cores (several sessions keep every core
/// computing), a frame's hop otherwise waits for the scheduler to take a core from a
/// compute, which lengthens every session's step (`bench serve --netns`, 3 nodes on 2
/// cores, two runs of each build: 2 streams 69.7 / 60.7 tok/s before, 77.1 / 64.6
/// after; 3 streams 80.4 / 65.1, then 90.7 / 82.2; one stream alike). A nice value
/// weighs only against threads of the same scheduling group: under systemd (the
/// service) or a desktop session's autogroup, that is the node's own threads, not the
/// owner's other programs. Linux only; elsewhere nothing.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority take no pointers; setpriority on this thread's id
    // changes only this thread's nice value, and its failure is harmless (ignored).
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, STAGE_NICE);
    }
}

/// The stage thread's nice value ([`lower_priority`]).
#[cfg(target_os = "linux")]
const STAGE_NICE: libc::c_int = 10;

/// Which queued job the stage runs next: the first decode step whose session has
/// nothing queued before it (a prompt chunk of another session waits a step's compute
/// rather than a stream waiting a whole prompt's), unless [`STEPS_BEFORE_CHUNK`] went
/// before the oldest job already (`passed`); else the oldest. A session's own jobs keep
/// their order (a replay queues its prompt chunks before its steps).
fn next_job(queue: &std::collections::VecDeque<Work>, passed: u32) -> usize {
    if passed >= STEPS_BEFORE_CHUNK {
        return 0;
    }
    let session = |w: &Work| match w {
        Work::Forward(q) => q.job.session,
        Work::Free(s) => *s,
    };
    queue
        .iter()
        .enumerate()
        .find(|&(i, w)| {
            matches!(w, Work::Forward(q) if q.step) && !queue.iter().take(i).any(|o| session(o) == session(w))
        })
        .map_or(0, |(i, _)| i)
}

/// Run one job on the stage, counting decode steps' compute time.
fn run_job(stage: &mut dyn Stage, job: &Job, stats: &ShellCounters) -> Result<StepOutput, String> {
    use std::sync::atomic::Ordering::Relaxed;
    let input = match &job.input {
        JobInput::Tokens(t) => StageInput::Tokens(t),
        JobInput::Hidden(h) => StageInput::Hidden(h),
    };
    // Only decode steps' compute is split on the thread's clock (a prompt chunk's is
    // not in the step breakdown).
    let step = is_step(job, stage.info().n_embd);
    let (t0, cpu0) = (Instant::now(), if step { thread_cpu_time() } else { None });
    let all_rows = job.flags & shoal_net::frame::FLAG_VERIFY != 0;
    let result = stage.forward_rows(SessionId(job.session), job.first_pos, input, all_rows);
    let took = t0.elapsed();
    if is_decode(job, stage.info().n_embd) {
        stats.decode_steps.fetch_add(1, Relaxed);
        stats.decode_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }
    if step {
        stats.steps.compute.add(took);
        if let Some(cpu) = cpu0.zip(thread_cpu_time()).map(|(before, after)| after.saturating_sub(before)) {
            stats.steps.compute_cpu.add(cpu.min(took));
        }
    }
    match result {
        Ok(StageOutput::Hidden(h)) => Ok(StepOutput::Hidden(h)),
        Ok(StageOutput::Logits(l)) => Ok(StepOutput::Logits(l)),
        Err(StageError::PositionGap { .. }) => Ok(StepOutput::Gap),
        Err(e) => Err(e.to_string()),
    }
}

/// This thread's CPU time so far: a compute's wall time less its CPU time is the time
/// the thread was off the CPU (with one CPU thread per stage: its core ran other
/// threads, as when a machine's stages and networking share its cores). `None` where
/// there is no such clock.
pub fn thread_cpu_time() -> Option<Duration> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid timespec this call writes; the clock id is a constant;
        // a failure (return code checked) leaves no figure.
        let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
        ok.then(|| Duration::new(u64::try_from(ts.tv_sec).unwrap_or(0), u32::try_from(ts.tv_nsec).unwrap_or(0)))
    }
    #[cfg(not(unix))]
    None
}

/// Whether `job` is a decode step (one token), whose timings make the node's profile.
fn is_decode(job: &Job, n_embd: u32) -> bool {
    match &job.input {
        JobInput::Tokens(t) => t.len() == 1,
        JobInput::Hidden(h) => h.len() == n_embd as usize,
    }
}

/// Whether `job` is any decode step: one token, or a verify step of 1 + k positions.
fn is_step(job: &Job, n_embd: u32) -> bool {
    is_decode(job, n_embd) || job.flags & shoal_net::frame::FLAG_VERIFY != 0
}

/// Whether `f` carries a decode step round the ring (a token back to the coordinator,
/// or one step's hidden states), not a prompt chunk or a control message.
fn is_step_frame(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Token => true,
        FrameKind::Hidden => f.n_tokens == 1 || f.flags & shoal_net::frame::FLAG_VERIFY != 0,
        _ => false,
    }
}

/// What the event loop hands the link task (and what the link task tells itself).
enum Link {
    /// A frame for the next node, and when the event loop handed it over.
    Frame(Frame, Instant),
    /// The next node restarted: its old connection is dead, connect again.
    Renew,
    /// The next node is at this address now (its machine was renumbered): the
    /// connection to the old one is dead, connect there.
    Moved(SocketAddr),
    /// The link task's own: its connection closed under it (QUIC's idle timeout after
    /// a long outage, or the next node's reset): connect again now, before the
    /// coordinator's next re-drive needs the link.
    Lost,
    /// The link task's own: time for the next attempt to connect again.
    Redial,
}

/// The link task's next instruction: a frame or renewal from the event loop; while
/// `connection` is open, news that the next node has moved (asked every
/// [`MOVE_CHECK`]) or that the connection closed; after `redial_in`, another try to
/// connect.
async fn next_link(
    frames: &mut mpsc::Receiver<Link>,
    check: &mut tokio::time::Interval,
    addresses: Option<&Addresses>,
    (peer, addr): (NodeId, SocketAddr),
    connection: Option<&quinn::Connection>,
    redial_in: Option<Duration>,
) -> Option<Link> {
    let closed = async {
        match connection {
            Some(c) => {
                c.closed().await;
            }
            None => std::future::pending().await,
        }
    };
    let redial = async {
        match redial_in {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(closed, redial);
    loop {
        tokio::select! {
            l = frames.recv() => return l,
            () = &mut closed => return Some(Link::Lost),
            () = &mut redial => return Some(Link::Redial),
            _ = check.tick() => {
                let moved = addresses.and_then(|a| a(peer)).filter(|a| *a != addr);
                if let (Some(now), true) = (moved, connection.is_some()) {
                    return Some(Link::Moved(now));
                }
            }
        }
    }
}

/// How often an open link asks where its next node is.
const MOVE_CHECK: Duration = Duration::from_millis(500);

/// Longest wait between two tries to connect to the next node.
const MAX_LINK_BACKOFF: Duration = Duration::from_millis(500);

/// Sends frames to the next node over one ordered stream, reconnecting with jittered
/// exponential backoff (from 5 ms up to [`MAX_LINK_BACKOFF`]) when the link is down —
/// including at startup, when the next node may not be listening yet, and as soon as
/// a connection closes, not only when the next frame finds it closed.
async fn link_task(
    node: Arc<Node>,
    next: crate::StagePlace,
    addresses: Option<Addresses>,
    mut frames: mpsc::Receiver<Link>,
    counters: Arc<ShellCounters>,
) {
    let peer = next.node;
    let mut addr = next.addr;
    let mut stream: Option<quinn::SendStream> = None;
    let mut connection: Option<quinn::Connection> = None;
    let mut pending: Option<Vec<u8>> = None;
    let mut backoff = Duration::from_millis(5);
    // Set while the link is down with no frame to send: when to try again.
    let mut redial: Option<Duration> = None;
    // How often an open link asks where the next node is: its connection to an address
    // the node no longer has would only end at QUIC's idle timeout.
    let mut check = tokio::time::interval(MOVE_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let jittered = |backoff: Duration| {
        backoff + Duration::from_micros(u64::from(rand_u32() % 1000) * backoff.as_micros() as u64 / 2000)
    };
    loop {
        // Set for a decode step's frame: when the link task took it, to time its write.
        let mut taken: Option<Instant> = None;
        let bytes = match pending.take() {
            Some(b) => Some(b),
            None => {
                match next_link(&mut frames, &mut check, addresses.as_ref(), (peer, addr), connection.as_ref(), redial)
                    .await
                {
                    Some(Link::Moved(now)) => {
                        tracing::info!(old = %addr, new = %now, "the next node has moved; connecting there");
                        if let Some(c) = connection.take() {
                            c.close(0u32.into(), b"you moved");
                        }
                        addr = now;
                        stream = None;
                        redial = Some(Duration::ZERO);
                        continue;
                    }
                    Some(Link::Frame(f, handed)) => {
                        if is_step_frame(&f) {
                            counters.steps.send_wait.add(handed.elapsed());
                            taken = Some(Instant::now());
                        }
                        Some(length_prefixed(&f))
                    }
                    Some(Link::Renew) => {
                        if let Some(c) = connection.take() {
                            tracing::info!(%addr, "the next node restarted; connecting again");
                            c.close(0u32.into(), b"you restarted");
                        }
                        stream = None;
                        redial = Some(Duration::ZERO);
                        continue;
                    }
                    Some(Link::Lost) => {
                        tracing::info!(%addr, "the link to the next stage closed; connecting again");
                        connection = None;
                        stream = None;
                        backoff = Duration::from_millis(5);
                        redial = Some(Duration::ZERO);
                        continue;
                    }
                    // A try to connect with no frame to send (below).
                    Some(Link::Redial) => None,
                    None => return,
                }
            }
        };
        if stream.is_none() {
            if let Some(now) = addresses.as_ref().and_then(|a| a(peer)).filter(|a| *a != addr) {
                tracing::info!(old = %addr, new = %now, "the next node has moved");
                addr = now;
            }
            if let Some((conn, s)) = dial(&node, addr, peer, &counters).await {
                connection = Some(conn);
                stream = Some(s);
                backoff = Duration::from_millis(5);
            }
        }
        redial = None;
        let Some(bytes) = bytes else {
            if stream.is_none() {
                redial = Some(jittered(backoff));
                backoff = (backoff * 2).min(MAX_LINK_BACKOFF);
            }
            continue;
        };
        let ok = match stream.as_mut() {
            Some(s) => s.write_all(&bytes).await.is_ok(),
            None => false,
        };
        if let (true, Some(t)) = (ok, taken) {
            counters.steps.write.add(t.elapsed());
        }
        if !ok {
            stream = None;
            connection = None;
            pending = Some(bytes);
            tokio::time::sleep(jittered(backoff)).await;
            backoff = (backoff * 2).min(MAX_LINK_BACKOFF);
        }
    }
}

/// One try to connect to the next node and open the frames' stream, within
/// [`CONNECT_TIMEOUT`]. The connection gets its refusal reader and its heartbeat.
async fn dial(
    node: &Node,
    addr: SocketAddr,
    peer: NodeId,
    counters: &Arc<ShellCounters>,
) -> Option<(quinn::Connection, quinn::SendStream)> {
    let attempt = tokio::time::timeout(CONNECT_TIMEOUT, node.connect(addr, peer, alpn::PIPELINE)).await;
    let conn = match attempt.map_err(|_| "timed out".to_string()).and_then(|c| c.map_err(|e| e.to_string())) {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(%addr, "connect: {e}");
            return None;
        }
    };
    match conn.open_uni().await {
        Ok(s) => {
            tokio::spawn(read_refusals(conn.clone(), counters.clone()));
            tokio::spawn(heartbeat(conn.clone()));
            counters.link_connects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(%addr, "link to the next stage up");
            Some((conn, s))
        }
        Err(e) => {
            tracing::debug!(%addr, "open stream: {e}");
            None
        }
    }
}

/// How often a link's sender sends its heartbeat.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

/// Sends a one-byte datagram every [`HEARTBEAT`] while `conn` is open. Frames flow one
/// way on a link, and QUIC resends unanswered packets after probe timeouts that double
/// each time: after a link was out for 4 s its sender would wait up to ~4 s more before
/// it tried again, and the receiver, with nothing to send, never asks. A packet every
/// beat is answered by an ACK as soon as the link is back, which makes the sender
/// declare the frames lost and resend them at once. (The connection still dies at the
/// idle timeout when nothing comes back: QUIC's idle timer restarts on what is
/// received.)
async fn heartbeat(conn: quinn::Connection) {
    let mut beat = tokio::time::interval(HEARTBEAT);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = beat.tick() => {}
            _ = conn.closed() => return,
        }
        // A peer that takes no datagrams (or a closed connection) ends the heartbeat.
        if conn.send_datagram(bytes::Bytes::from_static(&[0])).is_err() {
            return;
        }
    }
}

/// Tells the stage before this one, then the coordinator, that this stage has just
/// started ([`ControlRequest::Started`]): the one renews its link to this node at once
/// (its connection may be to this node's previous life, probing with QUIC's growing
/// timeouts), the other re-drives its generations, so a restarted stage's `Lost`
/// comes in a round trip instead of after the backoffs. Retried with backoff while
/// they are unreachable (a stage restarted while its link is down), for a minute; a
/// first start is announced the same way and costs a reconnect nobody waits for (and a
/// re-drive of whatever generation already runs: its steps then pass twice, answered
/// from the stages' caches). `counters.start_announced` is set once both took it in.
async fn announce_start(
    node: Arc<Node>,
    prev: crate::StagePlace,
    coordinator: crate::StagePlace,
    addresses: Option<Addresses>,
    counters: Arc<ShellCounters>,
) {
    let mut targets = vec![prev];
    if targets[0].node != coordinator.node {
        targets.push(coordinator);
    }
    let give_up = Instant::now() + Duration::from_secs(60);
    for mut target in targets {
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(now) = addresses.as_ref().and_then(|a| a(target.node)) {
                target.addr = now;
            }
            let attempt = tokio::time::timeout(CONNECT_TIMEOUT, crate::protocol::announce_started(&node, &target));
            match attempt.await.unwrap_or_else(|_| Err(PipelineError::Stream("timed out".into()))) {
                Ok(()) => break,
                Err(e) if Instant::now() >= give_up => {
                    tracing::debug!(addr = %target.addr, "could not announce the start: {e}");
                    return;
                }
                Err(e) => tracing::debug!(addr = %target.addr, "announcing the start: {e}"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
    counters.start_announced.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Accepts connections: pipeline frames only from the previous stage's node; control
/// requests (coordinator only) from any trusted key.
async fn accept_task(
    (mut pipeline, mut control): (Incoming, Incoming),
    prev: NodeId,
    limits: FrameLimits,
    events: mpsc::Sender<Event>,
    counters: Arc<ShellCounters>,
    admission: Arc<Admission>,
    starts: Arc<Starts>,
) {
    // Whether the previous stage has connected before.
    let mut renewed = false;
    loop {
        let acc = tokio::select! {
            a = pipeline.accept() => a,
            a = control.accept() => a,
            // The stage stopped: give the protocols back (later connections are closed).
            () = events.closed() => return,
        };
        let Some(acc) = acc else { return };
        let events = events.clone();
        if acc.alpn == alpn::PIPELINE {
            if acc.peer != prev {
                tracing::warn!(peer = %acc.peer, "pipeline connection from a node that is not the previous stage; closed");
                acc.conn.close(1u32.into(), b"not the previous stage");
                continue;
            }
            // A second connection from the same stage means the first closed, with
            // whatever it carried.
            if renewed {
                let _ = events.send(Event::LinkRenewed).await;
            }
            renewed = true;
            tokio::spawn(read_frames(acc.conn, limits, events, counters.clone()));
        } else if acc.alpn == alpn::CONTROL {
            tokio::spawn(serve_control(
                acc.conn,
                acc.peer,
                events,
                admission.clone(),
                counters.clone(),
                starts.clone(),
            ));
        } else {
            acc.conn.close(1u32.into(), b"protocol not served here");
        }
    }
}

/// Reads length-prefixed frames; malformed ones are logged and skipped.
async fn read_frames(
    conn: quinn::Connection,
    limits: FrameLimits,
    events: mpsc::Sender<Event>,
    counters: Arc<ShellCounters>,
) {
    let max = HEADER_LEN + (limits.max_tokens as usize * limits.n_embd as usize * 4).max(limits.max_message as usize);
    let mut refusals = 0u32;
    // The sender's heartbeats carry nothing: read and dropped, so they never queue.
    let beats = conn.clone();
    tokio::spawn(async move { while beats.read_datagram().await.is_ok() {} });
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
                    if events.send(Event::Frame(f, Instant::now())).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    counters.malformed_frames.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!("malformed frame rejected: {e}");
                    // Tell the sender (the first few times per connection: a flood of
                    // garbage must not become a flood of answers).
                    refusals += 1;
                    if refusals <= MAX_REFUSALS_PER_CONNECTION {
                        let msg = format!("malformed frame rejected: {e}").into_bytes();
                        tokio::spawn(send_refusal(conn.clone(), Frame::message(FrameKind::Error, 0, 0, 0, msg)));
                    }
                }
            }
        }
    }
}

/// Malformed frames answered per connection; later ones are only counted and logged.
const MAX_REFUSALS_PER_CONNECTION: u32 = 16;

/// Send one refusal back to the sender of a bad frame, on a stream of its own.
async fn send_refusal(conn: quinn::Connection, f: Frame) {
    if let Ok(mut s) = conn.open_uni().await {
        let _ = s.write_all(&length_prefixed(&f)).await;
        let _ = s.finish();
    }
}

/// A frame as it goes on a stream: its length (u32, little-endian), then its bytes.
fn length_prefixed(f: &Frame) -> Vec<u8> {
    let body = f.encode();
    let mut b = Vec::with_capacity(4 + body.len());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(&body);
    b
}

/// Sender side: log refusals the next stage sends back about our frames.
async fn read_refusals(conn: quinn::Connection, counters: Arc<ShellCounters>) {
    let limits = FrameLimits { n_embd: 1, max_tokens: 1, max_message: MAX_MESSAGE };
    while let Ok(mut rx) = conn.accept_uni().await {
        let Ok(bytes) = rx.read_to_end(MAX_MESSAGE as usize + HEADER_LEN + 4).await else { continue };
        if let Some(Ok(f)) = bytes.get(4..).map(|b| Frame::decode(b, &limits)) {
            counters.refused_by_next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!("the next stage refused a frame: {}", String::from_utf8_lossy(&f.payload));
        }
    }
}

/// Requests waiting for a session, per session the placement holds, before more are
/// refused as busy (HTTP 429): a queue long enough to ride out bursts, short enough
/// that a waiting client hears "busy" rather than waiting minutes.
pub const QUEUE_PER_SESSION: usize = 4;

/// The coordinator's admission: a generation runs only while it holds one of the
/// placement's sessions (every stage has that many KV slots), so sessions never run
/// out mid-pipeline; the others wait in arrival order (tokio's semaphore is FIFO),
/// up to a limit.
struct Admission {
    /// One permit per session.
    slots: Arc<tokio::sync::Semaphore>,
    /// Requests waiting now.
    waiting: std::sync::atomic::AtomicUsize,
    /// Most requests that may wait.
    limit: usize,
}

impl Admission {
    fn new(sessions: usize) -> Admission {
        let sessions = sessions.max(1);
        Admission {
            slots: Arc::new(tokio::sync::Semaphore::new(sessions)),
            waiting: Default::default(),
            limit: sessions * QUEUE_PER_SESSION,
        }
    }

    /// Wait for a session; `Err` with the reason when the queue is full.
    async fn enter(&self) -> Result<tokio::sync::OwnedSemaphorePermit, String> {
        use std::sync::atomic::Ordering::SeqCst;
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, SeqCst) >= self.limit {
            self.waiting.fetch_sub(1, SeqCst);
            return Err(format!("busy: every session runs and {} requests are waiting", self.limit));
        }
        struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _waiting = Waiting(&self.waiting);
        // Invariant: the semaphore is never closed.
        self.slots.clone().acquire_owned().await.map_err(|e| e.to_string())
    }
}

/// One generation per bidirectional stream: a JSON request in, JSON lines out.
async fn serve_control(
    conn: quinn::Connection,
    peer: NodeId,
    events: mpsc::Sender<Event>,
    admission: Arc<Admission>,
    counters: Arc<ShellCounters>,
    starts: Arc<Starts>,
) {
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let events = events.clone();
        let admission = admission.clone();
        let counters = counters.clone();
        let starts = starts.clone();
        tokio::spawn(async move {
            let reply = |e: GenEvent| {
                // Invariant: events are plain data and always serialise.
                let mut line = serde_json::to_vec(&e).expect("event serialises");
                line.push(b'\n');
                line
            };
            let req = match recv
                .read_to_end(MAX_REQUEST)
                .await
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<ControlRequest>(&b).map_err(|e| format!("bad request: {e}")))
            {
                Ok(ControlRequest::Generate(r)) => r,
                Ok(ControlRequest::Started) => {
                    // Answered once the event loop has it queued: its link renewal
                    // then goes before any frame the coordinator's re-drive brings,
                    // so the announcer can tell the coordinator next.
                    let _ = events.send(Event::Started(peer)).await;
                    let _ = send.finish();
                    let _ = send.stopped().await;
                    return;
                }
                Ok(ControlRequest::Status) => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    if events.send(Event::Status(tx)).await.is_ok() {
                        if let Ok(st) = rx.await {
                            // Invariant: the status is plain data and always serialises.
                            let _ = send.write_all(&serde_json::to_vec(&st).expect("status serialises")).await;
                        }
                    }
                    let _ = send.finish();
                    let _ = send.stopped().await;
                    return;
                }
                Err(e) => {
                    let _ = send.write_all(&reply(GenEvent::Error(e))).await;
                    let _ = send.finish();
                    return;
                }
            };
            // A resumption ends what is left of its earlier attempt (whose stream may
            // look alive here until QUIC's idle timeout): its session is freed for this.
            let entered = req.tag.map(|tag| starts.running.enter((peer, tag)));
            let end = entered.as_ref().map(|e| e.end.clone());
            let superseded = async move {
                match end {
                    Some(end) => end.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(superseded);
            // Held until the generation's stream ends: then its session is closed on
            // every stage (Close travels the same ordered link as the next Open).
            let _session = tokio::select! {
                () = &mut superseded => return,
                p = admission.enter() => match p {
                    Ok(p) => p,
                    Err(why) => {
                        let _ = send.write_all(&reply(GenEvent::Busy(why))).await;
                        let _ = send.finish();
                        return;
                    }
                },
                // The client left while waiting.
                _ = send.stopped() => return,
            };
            // A draft model's share of the start runs here, on a blocking thread.
            let speculates = starts.drafts.is_some() && req.speculative.is_some_and(|s| s.is_on());
            let (req, prepared) = if speculates {
                let starts = starts.clone();
                let prepare = move || {
                    let p = Prepared::new(starts.drafts.as_ref(), starts.n_ctx, starts.chunk, &req);
                    (req, p)
                };
                match tokio::task::spawn_blocking(prepare).await {
                    Ok((req, Ok(p))) => (req, Some(p)),
                    Ok((_, Err(e))) => {
                        let _ = send.write_all(&reply(GenEvent::Error(e))).await;
                        let _ = send.finish();
                        return;
                    }
                    Err(e) => {
                        let _ = send.write_all(&reply(GenEvent::Error(format!("preparing the generation: {e}")))).await;
                        let _ = send.finish();
                        return;
                    }
                }
            } else {
                (req, None)
            };
            let (tx, mut rx) = mpsc::channel(CLIENT_QUEUE);
            let (cut_tx, cut) = tokio::sync::oneshot::channel();
            if events.send(Event::Generate(req, Client { events: tx, cut: cut_tx }, prepared)).await.is_err() {
                return;
            }
            let writing = async {
                while let Some(ev) = rx.recv().await {
                    let end = !ev.is_token();
                    let t = Instant::now();
                    if send.write_all(&reply(ev)).await.is_err() {
                        return false;
                    }
                    if !end {
                        counters.steps.client_write.add(t.elapsed());
                    }
                    if end {
                        return true;
                    }
                }
                // The event loop dropped this client (its generation was cancelled).
                false
            };
            // Cut off by the event loop (the client did not read; writing is stuck on
            // its full stream), or the writing ended. A dropped `cut` (the client left
            // the event loop's table normally) does not match and is not a cut.
            let finished = tokio::select! {
                done = writing => Some(done),
                Ok(()) = cut => None,
                () = &mut superseded => {
                    tracing::info!(%peer, "a generation's client resumed it anew; this attempt ends");
                    None
                }
            };
            match finished {
                Some(true) => {
                    let _ = send.flush().await;
                    let _ = send.finish();
                    let _ = send.stopped().await;
                }
                Some(false) => {}
                None => {
                    let _ = send.reset(CUT_OFF.into());
                }
            }
        });
    }
}

/// Stream error code for a control client cut off because it did not read.
const CUT_OFF: u32 = 2;

/// This coordinator's incarnation: its start time, ms since 2020-01-01 UTC (it grows
/// from start to start unless the clock steps back; see `core::is_newer`).
fn incarnation_now() -> u64 {
    const Y2020_MS: u128 = 1_577_836_800_000;
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    ms.saturating_sub(Y2020_MS) as u64
}

/// A little randomness for jitter, without a crate: std's hasher is
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Session `session`'s job: a decode step (one token) or a prompt chunk of 128.
    fn job(session: u64, step: bool) -> Work {
        let tokens = if step { vec![1] } else { vec![1; 128] };
        Work::Forward(Queued {
            job: Job {
                session,
                epoch: 0,
                step: 0,
                first_pos: 0,
                flags: 0,
                input: JobInput::Tokens(tokens),
                step_tokens: Vec::new(),
            },
            at: Instant::now(),
            decode: step,
            step,
        })
    }

    #[test]
    fn decode_steps_go_before_other_sessions_prompt_chunks_not_their_own() {
        // Session 1's long prompt is queued; session 2's step arrives behind it.
        let q: VecDeque<Work> = [job(1, false), job(1, false), job(2, true), job(3, false)].into();
        assert_eq!(next_job(&q, 0), 2, "session 2's step runs before session 1's chunks");
        // A replay queues a session's chunks and then its steps: they keep their order.
        let q: VecDeque<Work> = [job(1, false), job(1, true), job(2, false)].into();
        assert_eq!(next_job(&q, 0), 0);
        // Nor may a step pass its own session's free.
        let q: VecDeque<Work> = [job(4, false), Work::Free(2), job(2, true)].into();
        assert_eq!(next_job(&q, 0), 0);
        // No steps: in order.
        let q: VecDeque<Work> = [job(1, false), job(2, false)].into();
        assert_eq!(next_job(&q, 0), 0);
        // Steps have gone before the oldest job long enough: it runs (no starving).
        let q: VecDeque<Work> = [job(1, false), job(2, true)].into();
        assert_eq!(next_job(&q, STEPS_BEFORE_CHUNK - 1), 1);
        assert_eq!(next_job(&q, STEPS_BEFORE_CHUNK), 0);
    }
}
