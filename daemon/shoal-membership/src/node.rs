//! The cluster node: the async shell around [`Core`]. One actor owns all state and runs
//! a `select!` loop over a clock tick, messages from members, discovery events, the
//! join endpoint and the owner's admin requests; tasks around it only move bytes.
//!
//! A node starts *unpaired* (or resumes the cluster it stored). Unpaired, it advertises
//! `cl=unpaired`; members that see it verify its key on its open join endpoint and list
//! it as pending. It becomes a member only through something its own owner did: a
//! pairing code or a join token typed or installed on it, or an approval from the
//! member its owner named (`shoal join --accept MEMBER-ID`). An approval alone, or one
//! from another member, or a welcome naming the right cluster from a stranger, is
//! refused. With no cluster on the LAN, the node
//! with the lowest id among the unpaired ones creates one.

use crate::core::{Action, Config, Core, Event, HardState, Liveness, Role as ElectionRole};
use crate::pairing::{Joiner, Offers, PairError, PairingCode, Responder, Secret};
use crate::state::{Change, ClusterState, Member};
use crate::token::{JoinToken, TokenId, Tokens};
use crate::wire::{
    read_msg, write_msg, AdminRequest, AdminResponse, ClusterStatus, JoinRequest, JoinResponse, MemberStatus,
    PendingStatus, PublicInfo, WireError,
};
use shoal_net::discovery::{Advert, Discovery, DiscoveryEvent, InterfaceFilter};
use shoal_net::{alpn, Identity, Node, Router, TransportOptions, TrustedKeys};
use shoal_store::{SledStore, Space, Store, StoreError, StoreExt};
use shoal_types::{ClusterId, NodeId, NodeInventory, Role};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

/// File in the data directory holding the main endpoint's address, for the CLI.
pub const ENDPOINT_FILE: &str = "endpoint";
/// File in the data directory holding a join token given at install (read at start,
/// deleted once the node joined with it).
pub const JOIN_TOKEN_FILE: &str = "join-token";
/// How long `shoal join --accept` lets an approval in.
const ACCEPT_MS: u64 = 10 * 60 * 1000;

/// When a node with no cluster creates one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CreatePolicy {
    /// After `after_ms` of listening, if no cluster is advertised on the LAN and no
    /// unpaired node with a lower id is either (so two fresh nodes agree who creates).
    Auto {
        /// How long to listen first.
        after_ms: u64,
    },
    /// At once.
    Now,
    /// Never: wait to be approved or to pair.
    Never,
}

/// How a cluster node runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Where the key and the store live.
    pub data_dir: PathBuf,
    /// The main endpoint (members only).
    pub listen: SocketAddr,
    /// The open join endpoint (port 0: any free port; it is advertised).
    pub join_listen: SocketAddr,
    /// A name for people.
    pub name: String,
    /// Hub or PC.
    pub role: Role,
    /// Interfaces mDNS may use.
    pub interfaces: InterfaceFilter,
    /// The HTTP port the admin page is served on, if any (`shoal_node::run` fills it in
    /// once the HTTP API is bound): a hub advertises it over mDNS as `Shoal._http._tcp`
    /// on the host `shoal.local` ([`Discovery::advertise_web`]); a PC never does.
    pub web_port: Option<u16>,
    /// Creating a cluster when there is none.
    pub create: CreatePolicy,
    /// The member (node id or prefix, at least [`ACCEPT_ID_DIGITS`] hex digits) whose
    /// approval this node's owner agreed to at start (`shoal serve --accept`); none:
    /// approvals are taken only after `shoal join --accept`. Codes and tokens join
    /// either way.
    pub accept: Option<String>,
    /// A join token given at install (`--join-token`, or [`JOIN_TOKEN_FILE`]): while
    /// unpaired, the node pairs with the member of the token's cluster that made it.
    pub join_token: Option<JoinToken>,
    /// Protocol timing.
    pub timing: Config,
    /// QUIC timing (and test impairment).
    pub transport: TransportOptions,
    /// Measures this node's speed on a model when asked ([`AdminRequest::Calibrate`]);
    /// `None`: such requests are refused. The engine lives above this crate, so the
    /// binary hands it in.
    pub calibrator: Option<Calibrator>,
}

/// A calibration asked of a node.
#[derive(Clone, Debug)]
pub struct CalibrationJob {
    /// The GGUF file on this node.
    pub model: PathBuf,
    /// Decode steps timed.
    pub tokens: u32,
    /// CPU threads; 0: as many as this node's stages use.
    pub threads: u32,
}

/// Most decode steps a calibration may be asked to time.
pub const MAX_CALIBRATION_TOKENS: u32 = 512;

impl CalibrationJob {
    /// A job from a request, within bounds: a regular `.gguf` file (not a device or a
    /// pipe, which could block the node), a bounded number of steps, no more threads
    /// than the machine has (0: the node's own stage threads).
    pub fn checked(model: &str, tokens: u32, threads: u32) -> Result<CalibrationJob, String> {
        let path = PathBuf::from(model);
        let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if !is_gguf || !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            return Err(format!("{model}: no such .gguf file on this node"));
        }
        if tokens == 0 || tokens > MAX_CALIBRATION_TOKENS {
            return Err(format!("calibration steps must be 1..={MAX_CALIBRATION_TOKENS}, not {tokens}"));
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        if threads > cpus {
            return Err(format!("threads must be 0 (as stages use) or 1..={cpus} on this node, not {threads}"));
        }
        Ok(CalibrationJob { model: path, tokens, threads })
    }
}

/// What a calibration returns: the cluster-state entry to keep (name, value), or why
/// it failed.
pub type CalibrationResult = Result<(String, serde_json::Value), String>;

/// Runs a calibration (blocking; on a thread of its own) and returns the cluster-state
/// entry to keep.
#[derive(Clone)]
pub struct Calibrator(pub Arc<dyn Fn(&CalibrationJob) -> CalibrationResult + Send + Sync>);

impl std::fmt::Debug for Calibrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Calibrator")
    }
}

/// Why the node stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The store failed: the node stops rather than act on state it could not keep.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The network could not be set up.
    #[error(transparent)]
    Net(#[from] shoal_net::NetError),
    /// Discovery could not start.
    #[error("discovery: {0}")]
    Discovery(#[from] shoal_net::discovery::DiscoveryError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The admin protocol failed.
    #[error("{0}")]
    Admin(String),
}

/// Everything that reaches the actor.
enum Input {
    Member(NodeId, crate::core::Msg, SocketAddr),
    /// A member opened a connection to this node from this address (its handshake
    /// proved its key): where it is now.
    Seen(NodeId, SocketAddr),
    /// This machine's own addresses changed (DHCP renumbered it): the members that
    /// dialled the old one must learn the new one.
    Renumbered,
    Admin(AdminRequest, oneshot::Sender<AdminResponse>),
    Verified(PublicInfo, SocketAddr),
    /// A discovered unpaired node did not answer its hello (it is tried again when
    /// discovery reports it again).
    VerifyFailed(NodeId),
    /// A pending node answered the welcome sent on approval.
    Welcomed {
        member: Member,
        taken: Result<(), String>,
        reply: oneshot::Sender<AdminResponse>,
    },
    /// A joiner begins a pairing exchange, with the member's code or a join token (id).
    PairBegin {
        token: Option<String>,
        reply: oneshot::Sender<Result<JoinSecret, PairError>>,
    },
    PairDone {
        ok: bool,
        info: PublicInfo,
        /// The token used, if it was one (consumed on success).
        token: Option<TokenId>,
        reply: oneshot::Sender<JoinResponse>,
    },
    /// A node asks whether it is (still) a member here.
    AmIMember {
        peer: NodeId,
        reply: oneshot::Sender<JoinResponse>,
    },
    /// The members asked about a removal notice answered: a majority of the membership
    /// without this node confirmed it (or not).
    RevocationChecked {
        from: NodeId,
        confirmed: bool,
    },
    /// A join with the token given at install ended.
    TokenJoined {
        result: Result<Box<ClusterState>, String>,
        /// No member that was tried answered (the error is about reaching them): worth
        /// trying again soon, unlike a member's refusal.
        unreachable: bool,
    },
    Welcome {
        from: NodeId,
        state: Box<ClusterState>,
        reply: oneshot::Sender<JoinResponse>,
    },
    Revoked {
        from: NodeId,
        state: Box<ClusterState>,
        reply: oneshot::Sender<JoinResponse>,
    },
    /// The outcome of a pairing attempt; `NoOffer` everywhere is retried a few times with
    /// fresh discovery results (the member showing the code may have just joined itself).
    JoinResult {
        result: Result<Box<ClusterState>, String>,
        code: JoinSecret,
        tries: u32,
        reply: oneshot::Sender<AdminResponse>,
    },
    /// A measurement (links or a calibration) finished: the entry to keep.
    Measured {
        key: String,
        value: Result<serde_json::Value, String>,
        /// It was a calibration (one runs at a time).
        calibration: bool,
        reply: oneshot::Sender<AdminResponse>,
    },
    /// Try pairing again.
    JoinRetry {
        code: JoinSecret,
        tries: u32,
        reply: oneshot::Sender<AdminResponse>,
    },
}

/// What a pairing exchange uses as its password.
#[derive(Clone, Debug)]
enum JoinSecret {
    /// The 8-digit code a member shows.
    Code(PairingCode),
    /// A join token (one cluster, one member that made it).
    Token(JoinToken),
}

impl Secret for JoinSecret {
    fn password(&self) -> Vec<u8> {
        match self {
            JoinSecret::Code(c) => c.password(),
            JoinSecret::Token(t) => t.password(),
        }
    }
}

impl JoinSecret {
    /// What the joiner sends beside its first message: the token's id, if a token.
    fn token_id(&self) -> Option<String> {
        match self {
            JoinSecret::Code(_) => None,
            JoinSecret::Token(t) => Some(t.id.to_string()),
        }
    }
}

/// An approval this node's owner agreed to take: from one member, named by its node
/// id. Not by a cluster id, which is public (every member's mDNS advert carries it): a
/// stranger could send a welcome into a state of its own making with the real id
/// (security review F2). A welcome comes over a connection that proved its sender's
/// key, which a stranger cannot forge.
#[derive(Clone, Debug)]
struct Acceptance {
    /// The approving member's node id or a prefix of it (lower-case hex, at least
    /// [`ACCEPT_ID_DIGITS`] digits).
    member: String,
    /// Until then (ms on the node's clock); none: while the node runs (given at start).
    until: Option<u64>,
}

/// Fewest hex digits of the approving member's id `--accept` takes: 64 bits, which no
/// one finds a key for by trying (12 digits, 48 bits, might take days of GPUs).
pub const ACCEPT_ID_DIGITS: usize = 16;

impl Acceptance {
    fn admits(&self, from: &NodeId, now: u64) -> bool {
        from.to_string().starts_with(&self.member) && self.until.is_none_or(|u| now < u)
    }
}

/// How joining with the token given at install goes.
#[derive(Debug, Default)]
struct TokenJoin {
    /// An attempt runs.
    trying: bool,
    /// The next attempt, not before (ms).
    next: u64,
    /// What `shoal status` says about it.
    status: String,
}

/// Who waits for a proposal's outcome.
enum Waiter {
    Approve {
        node: NodeId,
        reply: oneshot::Sender<AdminResponse>,
    },
    Remove {
        node: NodeId,
        reply: oneshot::Sender<AdminResponse>,
    },
    Put {
        key: String,
        reply: oneshot::Sender<AdminResponse>,
    },
    /// A node that paired with a code (it already holds the state it will be part of).
    Paired {
        node: NodeId,
    },
}

/// A proposal in flight: retried while the cluster has no leader or is busy, because
/// an approved node is already told it is in (it must not be left in limbo).
struct Proposal {
    change: Change,
    waiter: Waiter,
    /// Attempts so far.
    attempts: u32,
    /// Given up after this time (ms), well within the CLI's wait for an answer.
    deadline: u64,
}

/// Where the tokens a member made are kept ([`Space::Node`]).
const TOKENS_KEY: &str = "join_tokens";

/// Nodes discovery reports that are kept (members and pending nodes always): a LAN host
/// advertising thousands of made-up ids fills no more (security review F15).
const MAX_PEERS: usize = 512;
/// Unpaired nodes listed as pending at most (the admin page's list stays readable).
pub const MAX_PENDING: usize = 32;
/// Verifications of unpaired nodes' keys (a handshake each) under way at most.
const MAX_VERIFYING: usize = 8;

/// How long a proposal is retried while there is no leader (ms).
const PROPOSAL_MS: u64 = 30_000;

/// The node process's main endpoint, shared by membership and the other services
/// (pipeline stages, shard transfer): one UDP port, protocols told apart by ALPN.
#[derive(Clone)]
pub struct SharedEndpoint {
    /// The endpoint, bound with [`TrustedKeys`] `trusted`.
    pub node: Arc<Node>,
    /// The keys it accepts: membership keeps them equal to the cluster's members (plus
    /// this node's own key, which the local CLI uses).
    pub trusted: TrustedKeys,
    /// Routes its connections; membership takes the membership, probe and admin ones.
    pub router: Router,
}

impl SharedEndpoint {
    /// Bind the main endpoint on `listen`, trusting only this node's own key until
    /// membership adds the members.
    pub fn bind(listen: SocketAddr, identity: Arc<Identity>, transport: &TransportOptions) -> Result<Self, NodeError> {
        let trusted = TrustedKeys::new([identity.id()]);
        let node = Arc::new(Node::bind(listen, identity, trusted.clone(), transport)?);
        let router = Router::new(node.clone());
        Ok(SharedEndpoint { node, trusted, router })
    }
}

/// What the other services of the node process see of membership.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    /// The cluster state as adopted here (`None`: unpaired). A follower adopts the
    /// leader's snapshot before a majority has stored it; the next one supersedes it.
    pub state: Option<Arc<ClusterState>>,
    /// Where each member's main endpoint was last reached (proven by a handshake).
    pub addrs: BTreeMap<NodeId, SocketAddr>,
    /// The leader this node knows of.
    pub leader: Option<NodeId>,
    /// The members that are not down as seen from here (this node included).
    pub alive: BTreeSet<NodeId>,
    /// The main endpoint's address once the node serves (its endpoint file written,
    /// discovery started): the node process's readiness.
    pub listening: Option<SocketAddr>,
}

/// The node process's in-process way into membership: ask what the CLI can ask, and
/// watch the [`View`].
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Input>,
    view: watch::Receiver<View>,
}

/// The actor's end of a [`Handle`], given to [`run_shared`].
pub struct Inbox {
    tx: mpsc::Sender<Input>,
    rx: mpsc::Receiver<Input>,
    view: watch::Sender<View>,
}

impl Handle {
    /// A handle and the inbox the node (once running) serves it from.
    pub fn new() -> (Handle, Inbox) {
        let (tx, rx) = mpsc::channel(1024);
        let (view_tx, view) = watch::channel(View::default());
        (Handle { tx: tx.clone(), view }, Inbox { tx, rx, view: view_tx })
    }

    /// Ask as the node's owner (anything the CLI may ask).
    pub async fn ask(&self, req: AdminRequest) -> AdminResponse {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Input::Admin(req, reply)).await.is_err() {
            return AdminResponse::Error("the node is stopping".into());
        }
        rx.await.unwrap_or(AdminResponse::Error("the node is stopping".into()))
    }

    /// Membership as it changes.
    pub fn view(&self) -> watch::Receiver<View> {
        self.view.clone()
    }
}

/// Run a cluster node until `shutdown` completes, on a main endpoint of its own.
pub async fn run(
    cfg: NodeConfig,
    identity: Arc<Identity>,
    inventory: watch::Receiver<NodeInventory>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let shared = SharedEndpoint::bind(cfg.listen, identity.clone(), &cfg.transport)?;
    let main = shared.node.clone();
    let (_handle, inbox) = Handle::new();
    let r = run_shared(cfg, identity, inventory, shared, inbox, shutdown).await;
    main.close();
    r
}

/// Run a cluster node until `shutdown` completes, on `shared` (whose listen address
/// replaces `cfg.listen`). The caller closes the endpoint afterwards.
pub async fn run_shared(
    cfg: NodeConfig,
    identity: Arc<Identity>,
    inventory: watch::Receiver<NodeInventory>,
    shared: SharedEndpoint,
    inbox: Inbox,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let store: Arc<dyn Store> = Arc::new(SledStore::open(&cfg.data_dir)?);
    let me = identity.id();
    let SharedEndpoint { node: main, trusted, router } = shared;
    trusted.insert(me);
    let open = Arc::new(Node::bind_open(cfg.join_listen, identity.clone(), &cfg.transport)?);
    let main_addr = main.local_addr().map_err(|source| NodeError::Io { path: "main endpoint".into(), source })?;
    let join_addr = open.local_addr().map_err(|source| NodeError::Io { path: "join endpoint".into(), source })?;
    write_endpoint(&cfg.data_dir, main_addr)?;
    let inv = inventory.borrow().clone();
    let state: Option<ClusterState> = store.get_json(Space::Cluster, "state")?;
    let hard: HardState = store.get_json(Space::Election, "hard")?.unwrap_or_default();
    let advert = Advert::new(me, state.as_ref().map(|s| s.cluster), cfg.role, main_addr.port(), join_addr.port(), &inv);
    let (discovery, found) = Discovery::start(advert, &cfg.interfaces)?;
    if let Some(port) = cfg.web_port {
        match discovery.advertise_web(port) {
            Ok(true) => tracing::info!("admin page advertised as http://shoal.local:{port}/admin/"),
            Ok(false) => {}
            // The cluster works without it; the page is still at the box's address.
            Err(e) => tracing::warn!("cannot advertise shoal.local: {e}"),
        }
    }
    let Inbox { tx, rx, view } = inbox;
    let public = Arc::new(Mutex::new(PublicInfo {
        node: me,
        cluster: None,
        name: cfg.name.clone(),
        role: cfg.role,
        memory_bytes: memory_of(&inv),
        accepts_approval: cfg.accept.is_some(),
    }));
    let tokens: Tokens = store.get_json(Space::Node, TOKENS_KEY)?.unwrap_or_default();
    let accepting = cfg.accept.as_ref().map(|p| Acceptance { member: p.trim().to_ascii_lowercase(), until: None });
    tracing::info!(node = %me, %main_addr, %join_addr, "cluster node starting");
    let mut actor = Actor {
        seed: random_u64(),
        start: Instant::now(),
        me,
        store,
        main: main.clone(),
        open: open.clone(),
        trusted,
        trusted_set: BTreeSet::from([me]),
        core: None,
        discovery,
        inventory: inv,
        public: public.clone(),
        peers: HashMap::new(),
        pending: BTreeMap::new(),
        verifying: BTreeSet::new(),
        deferred: BTreeSet::new(),
        addrs: Arc::new(Mutex::new(HashMap::new())),
        hints: Arc::new(Mutex::new(HashMap::new())),
        join_addrs: Arc::new(Mutex::new(HashMap::new())),
        first_join_port: HashMap::new(),
        links: HashMap::new(),
        link_tasks: tokio::task::JoinSet::new(),
        waiting: HashMap::new(),
        retry: Vec::new(),
        next_req: 0,
        offers: Offers::default(),
        tokens,
        accepting,
        token_join: TokenJoin::default(),
        provisional: None,
        pairing_until: 0,
        committed_members: BTreeSet::new(),
        welcomed: HashMap::new(),
        traffic: Arc::new(Traffic::default()),
        calibrating: false,
        checking_revocation: false,
        leave_now: false,
        probing: false,
        tx: tx.clone(),
        view,
        main_addr,
        cfg,
    };
    if let Some(state) = state {
        // Also when the state no longer lists this node: its removal may not have
        // committed; the leader tells it once it has (`Revoked`).
        actor.resume(hard, state);
    } else if actor.cfg.create == CreatePolicy::Now {
        actor.create()?;
    }
    tokio::spawn(accept_main(main.clone(), router, tx.clone()));
    tokio::spawn(watch_addresses(tx.clone()));
    tokio::spawn(accept_join(open.clone(), tx, public, me));
    let r = actor.run(rx, found, inventory, shutdown).await;
    open.close();
    actor.discovery.shutdown();
    r
}

/// How long a stopping node waits for its links to deliver what they hold.
const STOP_FLUSH: Duration = Duration::from_millis(500);

/// Counters of membership traffic sent.
#[derive(Default)]
struct Traffic {
    msgs: AtomicU64,
    bytes: AtomicU64,
}

struct Actor {
    /// Election jitter for the core (fresh randomness per start).
    seed: u64,
    /// The clock's zero: the core works in ms since then.
    start: Instant,
    me: NodeId,
    store: Arc<dyn Store>,
    /// Members-only endpoint (membership, admin).
    main: Arc<Node>,
    /// Join endpoint (any key, join protocol only).
    open: Arc<Node>,
    /// Keys the main endpoint accepts: the members and ourselves (the CLI).
    trusted: TrustedKeys,
    /// Mirror of `trusted`, to compute changes.
    trusted_set: BTreeSet<NodeId>,
    /// The protocol, once this node belongs to a cluster.
    core: Option<Core>,
    discovery: Discovery,
    /// Latest inventory (advert, member record).
    inventory: NodeInventory,
    /// What the join endpoint tells anyone.
    public: Arc<Mutex<PublicInfo>>,
    /// Everyone discovery reports: advert and addresses.
    peers: HashMap<NodeId, (Advert, Vec<IpAddr>)>,
    /// Unpaired nodes whose key was verified on their join endpoint.
    pending: BTreeMap<NodeId, (PublicInfo, SocketAddr)>,
    /// Verifications under way.
    verifying: BTreeSet<NodeId>,
    /// Unpaired nodes whose verification waits for a place ([`MAX_VERIFYING`],
    /// [`MAX_PENDING`]): tried on a later tick.
    deferred: BTreeSet<NodeId>,
    /// Members' main endpoints, shared with the link tasks: where each was last reached.
    /// Only a successful handshake (which proves the member's key) puts an address here
    /// over one that is known; mDNS alone never replaces it.
    addrs: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
    /// Other addresses heard of for members (mDNS adverts, incoming connections): a link
    /// task tries one when the known address fails, and keeps it once the handshake there
    /// proved the member's key.
    hints: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
    /// Members' join endpoints where a handshake proved the member's key. Tried before
    /// the latest advert's port, so a forged advert (another port or address) cannot
    /// divert removal notices and membership checks once a member was reached there.
    join_addrs: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
    /// The join port of the first advert seen from each member: like `addrs`, a later
    /// advert does not replace it, so a forger cannot hide it behind another port.
    first_join_port: HashMap<NodeId, u16>,
    /// One sender task per member.
    links: HashMap<NodeId, mpsc::Sender<crate::core::Msg>>,
    /// The sender tasks, awaited when the node stops: what they hold (a leader's
    /// resignation) is delivered before the endpoint closes.
    link_tasks: tokio::task::JoinSet<()>,
    /// Proposals waiting for their outcome, by request number.
    waiting: HashMap<u64, Proposal>,
    /// Proposals to try again at a time.
    retry: Vec<(u64, Proposal)>,
    next_req: u64,
    /// Pairing codes offered here.
    offers: Offers,
    /// Join tokens made here (kept in the store: they outlive a restart).
    tokens: Tokens,
    /// Unpaired: the approval this node's owner agreed to take.
    accepting: Option<Acceptance>,
    /// Unpaired with a join token: the attempts.
    token_join: TokenJoin,
    /// Took a cluster state from a welcome or a pairing, and has not heard from any
    /// member since: back to unpaired after this time (ms).
    provisional: Option<u64>,
    /// A pairing exchange is under way until then (ms), or ended early.
    pairing_until: u64,
    /// Leader only: the members as of the last committed version (removed nodes are
    /// told once their removal commits, not before).
    committed_members: BTreeSet<NodeId>,
    /// Leader only: when each approved-but-still-unpaired node was last sent a welcome.
    welcomed: HashMap<NodeId, u64>,
    traffic: Arc<Traffic>,
    /// A calibration runs (it loads a model: one at a time).
    calibrating: bool,
    /// The members are being asked whether a removal notice is true.
    checking_revocation: bool,
    /// This node's own removal committed: leave at the next tick.
    leave_now: bool,
    /// A link probe runs (one at a time: probes at once would time each other).
    probing: bool,
    /// Clone for tasks that report back.
    /// What the node process's other services see (see [`View`]); sent when it changes.
    view: watch::Sender<View>,
    tx: mpsc::Sender<Input>,
    main_addr: SocketAddr,
    cfg: NodeConfig,
}

impl Actor {
    async fn run(
        &mut self,
        mut rx: mpsc::Receiver<Input>,
        mut found: mpsc::Receiver<DiscoveryEvent>,
        mut inventory: watch::Receiver<NodeInventory>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), NodeError> {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    self.stop().await;
                    return Ok(());
                }
                _ = tick.tick() => self.on_tick()?,
                Some(input) = rx.recv() => self.on_input(input)?,
                Some(event) = found.recv() => self.on_discovery(event),
                Ok(()) = inventory.changed() => {
                    self.inventory = inventory.borrow().clone();
                    lock(&self.public).memory_bytes = memory_of(&self.inventory);
                    self.advertise();
                }
            }
            self.publish();
        }
    }

    /// The node is stopping: a leader hands over (the others elect a successor at once
    /// instead of after an election timeout), and what the links hold is delivered,
    /// within [`STOP_FLUSH`].
    async fn stop(&mut self) {
        let now = self.now();
        let actions = self.core.as_mut().map(|core| core.resign(now)).unwrap_or_default();
        let handing_over = !actions.is_empty();
        if handing_over {
            tracing::info!("stopping: this leader hands over to the other members");
        }
        // Sends and events only (no persist): nothing here can fail.
        if let Err(e) = self.execute(actions) {
            tracing::warn!("handing over: {e}");
        }
        self.publish();
        // Closing the queues ends each link task once it has sent what it holds.
        self.links.clear();
        let tasks = &mut self.link_tasks;
        if !handing_over {
            // A follower's queued beats are not worth waiting for.
            tasks.abort_all();
            return;
        }
        if tokio::time::timeout(STOP_FLUSH, async { while tasks.join_next().await.is_some() {} }).await.is_err() {
            tracing::debug!("stopping: some members were not reached in time");
            tasks.abort_all();
        }
    }

    /// Tell the other services of the process if what they see changed.
    fn publish(&self) {
        let core = self.core.as_ref();
        let members: Vec<NodeId> = core.map(|c| c.state().members.keys().copied().collect()).unwrap_or_default();
        let addrs = lock(&self.addrs);
        let next = View {
            state: None,
            addrs: members.iter().filter_map(|m| Some((*m, *addrs.get(m)?))).collect(),
            leader: core.and_then(|c| c.leader()),
            // Suspected members count: a few missed beats are not worth re-placing a
            // model over; a member that stays silent goes down within seconds.
            alive: members
                .iter()
                .filter(|m| core.and_then(|c| c.liveness(m)) != Some(crate::core::Liveness::Down))
                .copied()
                .collect(),
            listening: Some(self.main_addr),
        };
        drop(addrs);
        self.view.send_if_modified(|v| {
            let version = core.map(|c| c.state().version);
            let same_state = match (&v.state, core) {
                (Some(s), Some(c)) => s.cluster == c.state().cluster && Some(s.version) == version,
                (None, None) => true,
                _ => false,
            };
            if same_state
                && v.addrs == next.addrs
                && v.leader == next.leader
                && v.alive == next.alive
                && v.listening == next.listening
            {
                return false;
            }
            *v = View {
                state: if same_state { v.state.clone() } else { core.map(|c| Arc::new(c.state().clone())) },
                ..next
            };
            true
        });
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn me_member(&self) -> Member {
        Member {
            id: self.me,
            name: self.cfg.name.clone(),
            role: self.cfg.role,
            memory_bytes: memory_of(&self.inventory),
        }
    }

    /// Create a new cluster with this node as its only member.
    fn create(&mut self) -> Result<(), NodeError> {
        let mut id = [0u8; 16];
        fill_random(&mut id);
        let state = ClusterState::create(ClusterId(id), self.me_member());
        tracing::info!(cluster = %state.cluster, "created a new cluster");
        self.adopt(state)
    }

    /// Store `state` as this node's cluster (fresh election state) and start in it.
    fn adopt(&mut self, state: ClusterState) -> Result<(), NodeError> {
        // The term and vote stored before are kept (they are never deleted): a node
        // removed and approved again must not vote twice in a term it voted in before.
        let hard: HardState = self.store.get_json(Space::Election, "hard")?.unwrap_or_default();
        blocking(|| self.store.put_json(Space::Cluster, "state", &state))?;
        self.resume(hard, state);
        Ok(())
    }

    fn resume(&mut self, hard: HardState, state: ClusterState) {
        let cluster = state.cluster;
        self.committed_members = state.members.keys().copied().collect();
        self.core = Some(Core::new(self.cfg.timing.clone(), self.me, hard, state, self.now(), self.seed));
        lock(&self.public).cluster = Some(cluster);
        self.sync_trust();
        self.advertise();
        tracing::info!(%cluster, "member of the cluster");
    }

    fn advertise(&mut self) {
        let cluster = self.core.as_ref().map(|c| c.state().cluster);
        let join_port = self.open.local_addr().map(|a| a.port()).unwrap_or(0);
        let advert = Advert::new(self.me, cluster, self.cfg.role, self.main_addr.port(), join_port, &self.inventory);
        if let Err(e) = self.discovery.update(advert) {
            tracing::warn!("cannot update the mDNS advert: {e}");
        }
    }

    /// Trust exactly the members (and ourselves); drop links to anyone else.
    fn sync_trust(&mut self) {
        let mut want = BTreeSet::from([self.me]);
        if let Some(core) = &self.core {
            want.extend(core.state().members.keys().copied());
        }
        for id in want.difference(&self.trusted_set) {
            self.trusted.insert(*id);
        }
        for id in self.trusted_set.difference(&want) {
            self.trusted.remove(id);
            self.links.remove(id);
            lock(&self.addrs).remove(id);
            lock(&self.hints).remove(id);
        }
        self.trusted_set = want;
        self.pending.retain(|id, _| !self.trusted_set.contains(id));
        // Members discovered before this node knew them (it just joined, or they were
        // just approved): their advertised main endpoint.
        let mut addrs = lock(&self.addrs);
        for id in &self.trusted_set {
            if let (false, Some((advert, ips))) = (addrs.contains_key(id), self.peers.get(id)) {
                if let Some(ip) = reachable(ips, self.main_addr) {
                    addrs.insert(*id, SocketAddr::new(*ip, advert.port));
                }
            }
        }
    }

    fn on_tick(&mut self) -> Result<(), NodeError> {
        let now = self.now();
        if std::mem::take(&mut self.leave_now) && self.core.is_some() {
            self.leave()?;
        }
        if self.provisional.is_some_and(|until| now >= until) {
            // Its approval never reached a member (the approver died before proposing,
            // or the change failed): nobody will ever talk to it in that cluster.
            tracing::warn!(
                "no member of the cluster this node was admitted to has been heard from in {} s; back to unpaired",
                self.cfg.timing.confirm_ms / 1000
            );
            self.forget("the approval was never confirmed by the cluster")?;
        }
        let accepts = self.core.is_none() && self.accepting.as_ref().is_some_and(|a| a.until.is_none_or(|u| now < u));
        if !accepts {
            self.accepting = None;
        }
        lock(&self.public).accepts_approval = accepts;
        if self.core.is_none() && self.cfg.join_token.is_some() {
            self.token_tick(now);
        }
        if let Some(core) = self.core.as_mut() {
            let actions = core.tick(now);
            self.execute(actions)?;
            self.welcome_approved(now);
            self.verify_unpaired();
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retry).into_iter().partition(|r| r.0 <= now);
            self.retry = later;
            for (_, p) in due {
                self.submit(p)?;
            }
        } else if let CreatePolicy::Auto { after_ms } = self.cfg.create {
            let cluster_seen = self.peers.values().any(|(a, _)| a.cluster.is_some());
            let lower_unpaired = self.peers.values().any(|(a, _)| a.cluster.is_none() && a.node < self.me);
            if now >= after_ms && !cluster_seen && !lower_unpaired {
                self.create()?;
            }
        }
        Ok(())
    }

    /// A member's handshake (or a message on a connection whose handshake did) came
    /// from `addr`: that is where it is now. QUIC validated the path before moving a
    /// connection to it, and only the member's key completes the handshake, so this
    /// replaces the known address at once (a renumbered member is reached there by
    /// every later dial: membership links, pipeline links, requests); an mDNS advert
    /// alone, unauthenticated, only ever gives a hint (`on_discovery`).
    fn seen_at(&self, from: NodeId, addr: SocketAddr) {
        let addr = canonical(addr);
        let mut addrs = lock(&self.addrs);
        let known = addrs.insert(from, addr);
        if known.is_some_and(|k| k != addr) {
            tracing::info!(node = %from, old = ?known, new = %addr, "a member has moved");
            lock(&self.hints).remove(&from);
        }
    }

    /// This machine has new addresses: open a connection to every member from them, so
    /// that each member's handshake check sees this node at its new address at once
    /// (`Input::Seen`) instead of when its connections to the old one time out. The
    /// connections this node opened itself move with it (QUIC migration).
    fn announce_address(&self) {
        let addrs = lock(&self.addrs).clone();
        let members: Vec<NodeId> =
            self.core.as_ref().map(|c| c.state().members.keys().copied().collect()).unwrap_or_default();
        tracing::info!("this machine's addresses changed; telling the members");
        for m in members.into_iter().filter(|m| *m != self.me) {
            let Some(addr) = addrs.get(&m).copied() else { continue };
            let main = self.main.clone();
            tokio::spawn(async move {
                // Retried a few times: the new address may still be settling (DAD).
                for wait in [0u64, 500, 1000, 2000, 4000] {
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    let dial = tokio::time::timeout(Duration::from_secs(3), main.connect(addr, m, alpn::MEMBERSHIP));
                    if let Ok(Ok(c)) = dial.await {
                        c.close(0u32.into(), b"announced");
                        return;
                    }
                }
                tracing::debug!(node = %m, "could not tell a member this node's new address");
            });
        }
    }

    fn on_input(&mut self, input: Input) -> Result<(), NodeError> {
        let now = self.now();
        match input {
            Input::Member(from, msg, addr) => {
                if self.core.is_some() {
                    // A member talks to us: it applied the state that admits us.
                    self.provisional = None;
                    self.seen_at(from, addr);
                }
                if let Some(core) = self.core.as_mut() {
                    let actions = core.receive(now, from, msg);
                    self.execute(actions)?;
                }
            }
            Input::Seen(from, addr) => {
                if self.core.as_ref().is_some_and(|c| c.state().members.contains_key(&from)) {
                    self.seen_at(from, addr);
                }
            }
            Input::Renumbered => self.announce_address(),
            Input::Admin(req, reply) => self.on_admin(req, reply)?,
            Input::VerifyFailed(node) => {
                self.verifying.remove(&node);
            }
            Input::Verified(mut info, addr) => {
                self.verifying.remove(&info.node);
                info.name = crate::wire::clean_name(&info.name);
                let known = self
                    .core
                    .as_ref()
                    .is_some_and(|c| c.state().is_member(&info.node) || c.state().revoked.contains(&info.node));
                // Listed whether or not its owner armed it to take an approval yet: an
                // approval then fails with the reason, and works once armed.
                if info.cluster.is_none() && !known && self.pending.len() >= MAX_PENDING {
                    tracing::warn!(node = %info.node, "{MAX_PENDING} nodes wait to be approved already: not listed");
                } else if info.cluster.is_none() && !known {
                    tracing::info!(node = %info.node, name = %info.name, "pending: an unpaired node asks to join");
                    self.pending.insert(info.node, (info, addr));
                }
            }
            Input::Welcomed { member, taken, reply } => match taken {
                Ok(()) if self.core.is_some() => {
                    let node = member.id;
                    self.propose(Change::AddMember(member), Waiter::Approve { node, reply })?;
                }
                Ok(()) => {
                    let _ = reply.send(AdminResponse::Error("this node left the cluster meanwhile".into()));
                }
                Err(e) => {
                    let _ = reply.send(AdminResponse::Error(format!("{} did not take the approval: {e}", member.id)));
                }
            },
            Input::PairBegin { token, reply } => {
                let r = match (&self.core, token) {
                    (None, _) => Err(PairError::NoOffer),
                    // One exchange at a time, so one code admits one node.
                    _ if self.pairing_until > now => Err(PairError::TooSoon { wait_ms: self.pairing_until - now }),
                    (Some(core), Some(id)) => {
                        let cluster = core.state().cluster;
                        let begun = id.parse::<TokenId>().and_then(|id| self.tokens.begin(cluster, id, unix_ms()));
                        // The attempt counts even if the node stops now.
                        self.save_tokens()?;
                        begun.map(JoinSecret::Token)
                    }
                    (Some(_), None) => match self.offers.begin(now) {
                        // An expired or used-up code here is as good as none: the joiner
                        // tries the other members.
                        Err(PairError::Expired | PairError::TooManyAttempts) => Err(PairError::NoOffer),
                        r => r.map(JoinSecret::Code),
                    },
                };
                if r.is_ok() {
                    self.pairing_until = now + 35_000;
                }
                let _ = reply.send(r);
            }
            Input::PairDone { ok, mut info, token, reply } => {
                self.pairing_until = 0;
                info.name = crate::wire::clean_name(&info.name);
                if !ok {
                    self.offers.failed();
                    let _ = reply.send(JoinResponse::Error(PairError::WrongCode.to_string()));
                    return Ok(());
                }
                match token {
                    Some(id) => {
                        self.tokens.succeeded(id);
                        self.save_tokens()?;
                    }
                    None => self.offers.succeeded(),
                }
                let member =
                    Member { id: info.node, name: info.name, role: info.role, memory_bytes: info.memory_bytes };
                tracing::info!(node = %member.id, "paired with a code; proposing it as a member");
                // The new node gets the state it will be part of now: the change commits
                // only once a majority of the *new* membership stored it, and the new node
                // counts in it, so it must already take part.
                let Some(state) = self.expected(&member) else {
                    let _ = reply.send(JoinResponse::Error("this node left the cluster meanwhile".into()));
                    return Ok(());
                };
                let _ = reply.send(JoinResponse::Joined { state: Box::new(state) });
                let node = member.id;
                self.propose(Change::AddMember(member), Waiter::Paired { node })?;
            }
            Input::Welcome { from, state, reply } => {
                let answer = self.on_welcome(from, *state)?;
                let _ = reply.send(answer);
            }
            Input::Revoked { from, state, reply } => {
                let genuine = self.core.as_ref().is_some_and(|c| {
                    let mine = c.state();
                    state.cluster == mine.cluster
                        && mine.is_member(&from)
                        && state.is_member(&from)
                        && !state.is_member(&self.me)
                        && state.version >= mine.version
                });
                if genuine {
                    // Any member could send this; only the cluster's decision counts: the
                    // members are asked, and a majority of them must say so.
                    let _ = reply.send(JoinResponse::Accepted);
                    if !self.checking_revocation {
                        self.check_revocation(from, 4);
                    }
                } else {
                    tracing::warn!(%from, "ignored a removal notice that does not come from this node's cluster");
                    let _ = reply.send(JoinResponse::Error("not a removal this node can verify".into()));
                }
            }
            Input::RevocationChecked { from, confirmed } => {
                self.checking_revocation = false;
                if confirmed && self.core.is_some() {
                    self.leave()?;
                } else if self.core.is_some() {
                    tracing::warn!(%from, "a removal notice was not confirmed by a majority of the members; ignored");
                }
            }
            Input::AmIMember { peer, reply } => {
                let answer = match &self.core {
                    Some(core) => JoinResponse::Membership {
                        cluster: core.state().cluster,
                        version: core.state().version,
                        member: core.state().is_member(&peer),
                    },
                    None => JoinResponse::Error("this node is not in a cluster".into()),
                };
                let _ = reply.send(answer);
            }
            Input::TokenJoined { result, unreachable } => {
                self.token_join.trying = false;
                self.on_token_joined(result, unreachable)?;
            }
            Input::JoinResult { result: Err(e), code, tries, reply } if e == NO_OFFER && tries < 6 => {
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let _ = tx.send(Input::JoinRetry { code, tries: tries + 1, reply }).await;
                });
            }
            Input::JoinRetry { code, tries, reply } => {
                if self.core.is_some() {
                    let _ = reply.send(AdminResponse::Error("this node already belongs to a cluster".into()));
                } else {
                    self.try_join(code, tries, reply);
                }
            }
            Input::Measured { key, value, calibration, reply } => {
                if calibration {
                    self.calibrating = false;
                } else {
                    self.probing = false;
                }
                match value {
                    Ok(value) if self.core.is_some() => {
                        self.propose(Change::Put { key: key.clone(), value }, Waiter::Put { key, reply })?
                    }
                    Ok(_) => {
                        let _ = reply.send(AdminResponse::Error("this node left the cluster meanwhile".into()));
                    }
                    Err(e) => {
                        let _ = reply.send(AdminResponse::Error(e));
                    }
                }
            }
            Input::JoinResult { result, reply, .. } => match result {
                Ok(state) if self.core.is_none() && state.is_member(&self.me) => {
                    let cluster = state.cluster;
                    self.adopt(*state)?;
                    self.provisional = Some(self.now() + self.cfg.timing.confirm_ms);
                    let _ = reply.send(AdminResponse::Ok(format!("joined cluster {cluster}")));
                }
                Ok(_) if self.core.is_some() => {
                    let _ = reply.send(AdminResponse::Error(
                        "this node joined a cluster meanwhile (approved by a member)".into(),
                    ));
                }
                Ok(_) => {
                    let _ = reply.send(AdminResponse::Error("the pairing ended without a usable cluster state".into()));
                }
                Err(e) => {
                    let _ = reply.send(AdminResponse::Error(e));
                }
            },
        }
        Ok(())
    }

    fn on_welcome(&mut self, from: NodeId, state: ClusterState) -> Result<JoinResponse, NodeError> {
        if self.core.is_some() {
            return Ok(JoinResponse::Error("this node already belongs to a cluster".into()));
        }
        let now = self.now();
        if !self.accepting.as_ref().is_some_and(|a| a.admits(&from, now)) {
            // Approval alone is never enough: a stranger's cluster on the LAN must not
            // adopt a node whose owner did nothing, nor one whose owner agreed to
            // another member.
            tracing::info!(%from, cluster = %state.cluster, "refused an approval its owner did not agree to");
            return Ok(JoinResponse::Error(format!(
                "this node takes an approval only from the member its owner names: run `shoal join --accept {}` \
                 on it (this member's id), or join with a pairing code or a join token",
                &from.to_string()[..ACCEPT_ID_DIGITS]
            )));
        }
        let last: Option<ClusterState> = self.store.get_json(Space::Cluster, "last")?;
        if let Some(last) = last.filter(|l| l.cluster == state.cluster && l.version > state.version) {
            // Approved again, but by a member that has not yet seen what this node saw
            // last (it may hold committed changes): wait for a newer welcome.
            tracing::info!(%from, "a welcome older than this node's last state ({}); waiting for a newer one", last.version);
            return Ok(JoinResponse::Error("this node has seen a newer cluster state; retry later".into()));
        }
        if !state.is_member(&self.me) || !state.is_member(&from) {
            tracing::warn!(%from, "refused a welcome that does not list both sides as members");
            return Ok(JoinResponse::Error("the state does not list this node and the sender as members".into()));
        }
        tracing::info!(%from, cluster = %state.cluster, "approved by a member; joining");
        self.adopt(state)?;
        self.accepting = None;
        self.provisional = Some(now + self.cfg.timing.confirm_ms);
        Ok(JoinResponse::Accepted)
    }

    fn on_admin(&mut self, req: AdminRequest, reply: oneshot::Sender<AdminResponse>) -> Result<(), NodeError> {
        match req {
            AdminRequest::Status => {
                let _ = reply.send(AdminResponse::Status(Box::new(self.status())));
            }
            AdminRequest::Approve { node } => {
                if self.core.is_none() {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster yet".into()));
                    return Ok(());
                }
                match find(&node, self.pending.keys()) {
                    Ok(id) => {
                        let (info, _) = &self.pending[&id];
                        let member =
                            Member { id, name: info.name.clone(), role: info.role, memory_bytes: info.memory_bytes };
                        // As with pairing, the node must take part before the change can
                        // commit (it counts in the new majority): it is proposed only once
                        // it took the state it will be part of.
                        let Some(state) = self.expected(&member) else { return Ok(()) };
                        let (_, addr) = self.pending[&id];
                        let (open, tx) = (self.open.clone(), self.tx.clone());
                        tokio::spawn(async move {
                            let taken =
                                match join_request(&open, addr, id, &JoinRequest::Welcome { state: Box::new(state) })
                                    .await
                                {
                                    Ok(JoinResponse::Accepted) => Ok(()),
                                    Ok(JoinResponse::Error(e)) => Err(e),
                                    Ok(other) => Err(format!("unexpected answer {other:?}")),
                                    Err(e) => Err(e),
                                };
                            let _ = tx.send(Input::Welcomed { member, taken, reply }).await;
                        });
                    }
                    Err(e) => {
                        let _ = reply.send(AdminResponse::Error(format!("{e} among the pending nodes")));
                    }
                }
            }
            AdminRequest::Remove { node } => {
                let Some(core) = &self.core else {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                };
                match find(&node, core.state().members.keys()) {
                    Ok(id) => {
                        // The new membership must still have a live majority, or nothing
                        // could be decided afterwards (not even undoing this).
                        let rest: Vec<&NodeId> = core.state().members.keys().filter(|m| **m != id).collect();
                        let alive = rest.iter().filter(|m| core.liveness(m) == Some(Liveness::Alive)).count();
                        if alive < rest.len() / 2 + 1 {
                            let _ = reply.send(AdminResponse::Error(format!(
                                "removing {id} would leave {alive} of {} members reachable, not a majority; bring the others back (or remove a down member) first",
                                rest.len()
                            )));
                            return Ok(());
                        }
                        self.propose(Change::RemoveMember(id), Waiter::Remove { node: id, reply })?
                    }
                    Err(e) => {
                        let _ = reply.send(AdminResponse::Error(format!("{e} among the members")));
                    }
                }
            }
            AdminRequest::Put { key, value } => {
                if self.core.is_none() {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                }
                self.propose(Change::Put { key: key.clone(), value }, Waiter::Put { key, reply })?;
            }
            AdminRequest::Delete { key } => {
                if self.core.is_none() {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                }
                self.propose(Change::Delete { key: key.clone() }, Waiter::Put { key, reply })?;
            }
            AdminRequest::Entries { prefix } => {
                let entries = self
                    .core
                    .as_ref()
                    .map(|c| {
                        c.state()
                            .entries
                            .range(prefix.clone()..)
                            .take_while(|(k, _)| k.starts_with(&prefix))
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                let _ = reply.send(AdminResponse::Entries(entries));
            }
            AdminRequest::ProbeLinks { frame_bytes } => {
                let Some(core) = &self.core else {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                };
                if frame_bytes == 0 || frame_bytes > shoal_net::probe::MAX_FRAME_BYTES {
                    let _ = reply.send(AdminResponse::Error(format!(
                        "frame size {frame_bytes} is out of bounds (1..={})",
                        shoal_net::probe::MAX_FRAME_BYTES
                    )));
                    return Ok(());
                }
                if self.probing {
                    let _ = reply.send(AdminResponse::Error("a link probe already runs on this node".into()));
                    return Ok(());
                }
                let addrs = lock(&self.addrs);
                let peers: Vec<(NodeId, SocketAddr)> = core
                    .state()
                    .members
                    .keys()
                    .filter(|m| **m != self.me && core.liveness(m) == Some(Liveness::Alive))
                    .filter_map(|m| addrs.get(m).map(|a| (*m, *a)))
                    .collect();
                drop(addrs);
                if peers.is_empty() {
                    let _ = reply.send(AdminResponse::Error("no other live member to probe".into()));
                    return Ok(());
                }
                self.probing = true;
                let (main, tx, me) = (self.main.clone(), self.tx.clone(), self.me);
                tokio::spawn(async move {
                    let value = probe_links(&main, &peers, frame_bytes).await;
                    let key = LinksEntry::key(&me);
                    let _ = tx.send(Input::Measured { key, value, calibration: false, reply }).await;
                });
            }
            AdminRequest::Calibrate { model, tokens, threads } => {
                if self.core.is_none() {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                }
                let Some(calibrator) = self.cfg.calibrator.clone() else {
                    let _ = reply.send(AdminResponse::Error("this node cannot calibrate (no engine)".into()));
                    return Ok(());
                };
                if self.calibrating {
                    let _ = reply.send(AdminResponse::Error("a calibration already runs on this node".into()));
                    return Ok(());
                }
                let job = match CalibrationJob::checked(&model, tokens, threads) {
                    Ok(job) => job,
                    Err(e) => {
                        let _ = reply.send(AdminResponse::Error(e));
                        return Ok(());
                    }
                };
                tracing::info!(model = %job.model.display(), "calibrating");
                self.calibrating = true;
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let done = tokio::task::spawn_blocking(move || (calibrator.0)(&job)).await;
                    let (key, value) = match done {
                        Ok(Ok((key, value))) => (key, Ok(value)),
                        Ok(Err(e)) => (String::new(), Err(e)),
                        Err(e) => (String::new(), Err(format!("the calibration failed: {e}"))),
                    };
                    let _ = tx.send(Input::Measured { key, value, calibration: true, reply }).await;
                });
            }
            AdminRequest::Pair => {
                if self.core.is_none() {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster yet".into()));
                    return Ok(());
                }
                let now = self.now();
                let code = self.offers.offer(now);
                let valid_s = self.offers.active(now).map_or(0, |until| until.saturating_sub(now) / 1000);
                let _ = reply.send(AdminResponse::Code { code: code.to_string(), valid_s });
            }
            AdminRequest::Join { code } => {
                if self.core.is_some() {
                    let _ = reply.send(AdminResponse::Error("this node already belongs to a cluster".into()));
                    return Ok(());
                }
                let secret = if crate::token::is_token(&code) {
                    code.parse::<JoinToken>().map(JoinSecret::Token)
                } else {
                    code.parse::<PairingCode>().map(JoinSecret::Code)
                };
                match secret {
                    Ok(secret) => self.try_join(secret, 1, reply),
                    Err(e) => {
                        let _ = reply.send(AdminResponse::Error(format!("{e}")));
                    }
                }
            }
            AdminRequest::Accept { member } => {
                let answer = self.accept(&member);
                let _ = reply.send(answer);
            }
            AdminRequest::Token { valid_s } => {
                let Some(core) = &self.core else {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster yet".into()));
                    return Ok(());
                };
                if valid_s == 0 {
                    let _ = reply.send(AdminResponse::Error("a token must be valid for at least a second".into()));
                    return Ok(());
                }
                let cluster = core.state().cluster;
                let token = self.tokens.issue(cluster, unix_ms(), valid_s.saturating_mul(1000));
                self.save_tokens()?;
                tracing::info!(id = %token.id, "made a join token");
                let valid_s = valid_s.min(crate::token::MAX_TOKEN_TTL_MS / 1000);
                let _ = reply.send(AdminResponse::Code { code: token.to_string(), valid_s });
            }
            AdminRequest::Leave => {
                let Some(core) = &self.core else {
                    let _ = reply.send(AdminResponse::Error("this node is not in a cluster".into()));
                    return Ok(());
                };
                if core.state().members.len() == 1 {
                    let _ = reply.send(AdminResponse::Error(
                        "this node is its cluster's only member: `shoal reset` forgets the cluster".into(),
                    ));
                    return Ok(());
                }
                let me = self.me;
                let rest: Vec<&NodeId> = core.state().members.keys().filter(|m| **m != me).collect();
                let alive = rest.iter().filter(|m| core.liveness(m) == Some(Liveness::Alive)).count();
                if alive < rest.len() / 2 + 1 {
                    let _ = reply.send(AdminResponse::Error(format!(
                        "only {alive} of the other {} members are reachable, not a majority, so they cannot agree \
                         that this node leaves; bring them back, or `shoal reset` to forget the cluster here only",
                        rest.len()
                    )));
                    return Ok(());
                }
                self.propose(Change::RemoveMember(me), Waiter::Remove { node: me, reply })?;
                // The leader's answer may never reach us (its links to us go with our
                // key): the members are asked until a majority no longer lists us.
                if !self.checking_revocation {
                    self.check_revocation(me, 30);
                }
            }
            AdminRequest::Reset => {
                let answer = match self.core.as_ref().map(|c| c.state().cluster) {
                    None => AdminResponse::Ok("this node is not in a cluster; nothing to forget".into()),
                    Some(cluster) => {
                        self.forget("reset by its owner")?;
                        AdminResponse::Ok(format!(
                            "this node forgot cluster {cluster} and is unpaired now; on a member of that cluster, \
                             `shoal nodes remove {}` revokes its key there",
                            &self.me.to_string()[..12]
                        ))
                    }
                };
                let _ = reply.send(answer);
            }
        }
        Ok(())
    }

    /// The cluster state as it will be once `member` is added (what it is welcomed with).
    fn expected(&self, member: &Member) -> Option<ClusterState> {
        let mut state = self.core.as_ref()?.state().clone();
        // Already a member (a retried approval) is fine: the state holds it.
        let _ = state.apply(&Change::AddMember(member.clone()));
        Some(state)
    }

    /// The join endpoints of the members discovery knows of (of `cluster` only, if given).
    fn join_targets(&self, cluster: Option<ClusterId>) -> Vec<(NodeId, SocketAddr)> {
        let mut targets: Vec<(NodeId, SocketAddr)> = self
            .peers
            .values()
            .filter(|(a, _)| a.cluster.is_some() && (cluster.is_none() || a.cluster == cluster))
            .filter_map(|(a, ips)| reachable(ips, self.main_addr).map(|ip| (a.node, SocketAddr::new(*ip, a.join_port))))
            .collect();
        targets.sort();
        targets
    }

    /// Pair with `code` (or a token) with the members discovery knows of.
    fn try_join(&mut self, code: JoinSecret, tries: u32, reply: oneshot::Sender<AdminResponse>) {
        let cluster = match &code {
            JoinSecret::Token(t) => Some(t.cluster),
            JoinSecret::Code(_) => None,
        };
        let targets = self.join_targets(cluster);
        let info = lock(&self.public).clone();
        let (open, tx) = (self.open.clone(), self.tx.clone());
        tokio::spawn(async move {
            let result = join_with_code(&open, &code, info, &targets).await;
            let _ = tx.send(Input::JoinResult { result, code, tries, reply }).await;
        });
    }

    /// `shoal join --accept MEMBER`: take an approval from that member (its node id, or
    /// its first [`ACCEPT_ID_DIGITS`] hex digits or more) for a while.
    fn accept(&mut self, member: &str) -> AdminResponse {
        if self.core.is_some() {
            return AdminResponse::Error("this node already belongs to a cluster".into());
        }
        let member = member.trim().to_ascii_lowercase();
        let hex = member.chars().all(|c| c.is_ascii_hexdigit());
        if hex && member.len() >= 8 && self.lan_clusters().iter().any(|(c, _)| c.to_string().starts_with(&member)) {
            return AdminResponse::Error(format!(
                "{member} is a cluster's id, which anyone on the LAN can see: give the node id of the member \
                 that will approve this node (`shoal key` on it, or its `shoal status`; at least {ACCEPT_ID_DIGITS} \
                 hex digits)"
            ));
        }
        if member.len() < ACCEPT_ID_DIGITS || member.len() > 64 || !hex {
            return AdminResponse::Error(format!(
                "give the node id of the member that will approve this node, at least its first {ACCEPT_ID_DIGITS} \
                 hex digits (`shoal key` on it, or its `shoal status`)"
            ));
        }
        // Where the member was seen, for the owner to check it is the one they meant.
        let seen = self
            .peers
            .values()
            .find(|(a, _)| a.node.to_string().starts_with(&member))
            .map(|(a, _)| (a.node, a.cluster));
        let until = self.now() + ACCEPT_MS;
        self.accepting = Some(Acceptance { member: member.clone(), until: Some(until) });
        lock(&self.public).accepts_approval = true;
        tracing::info!(%member, "the owner agreed to an approval from this member");
        let whom = match seen {
            Some((id, Some(cluster))) => format!("member {id} (of cluster {cluster})"),
            Some((id, None)) => format!("node {id} (it advertises no cluster yet)"),
            None => format!("node {member}… (not seen on the LAN yet)"),
        };
        AdminResponse::Ok(format!(
            "this node takes an approval from {whom} for the next {} min: approve it there with \
             `shoal nodes approve {}`",
            ACCEPT_MS / 60_000,
            &self.me.to_string()[..12]
        ))
    }

    /// Clusters advertised on the LAN, with how many nodes advertise each.
    fn lan_clusters(&self) -> Vec<(ClusterId, usize)> {
        let mut seen: BTreeMap<ClusterId, usize> = BTreeMap::new();
        for (advert, _) in self.peers.values() {
            if let Some(c) = advert.cluster {
                *seen.entry(c).or_default() += 1;
            }
        }
        seen.into_iter().collect()
    }

    fn save_tokens(&self) -> Result<(), NodeError> {
        blocking(|| self.store.put_json(Space::Node, TOKENS_KEY, &self.tokens))?;
        Ok(())
    }

    /// Unpaired with a join token: try the members of its cluster now and then.
    fn token_tick(&mut self, now: u64) {
        let Some(token) = self.cfg.join_token.clone() else { return };
        if self.token_join.trying || now < self.token_join.next {
            return;
        }
        let targets = self.join_targets(Some(token.cluster));
        if targets.is_empty() {
            self.token_join.status = format!("waiting to discover a member of cluster {}", token.cluster);
            self.token_join.next = now + 1000;
            return;
        }
        self.token_join.trying = true;
        let info = lock(&self.public).clone();
        let (open, tx) = (self.open.clone(), self.tx.clone());
        tokio::spawn(async move {
            let (result, unreachable) = match join_attempt(&open, &JoinSecret::Token(token), info, &targets).await {
                Ok(state) => (Ok(state), false),
                Err((e, answered)) => (Err(e), !answered),
            };
            let _ = tx.send(Input::TokenJoined { result, unreachable }).await;
        });
    }

    fn on_token_joined(
        &mut self,
        result: Result<Box<ClusterState>, String>,
        unreachable: bool,
    ) -> Result<(), NodeError> {
        let now = self.now();
        let Some(token) = self.cfg.join_token.clone() else { return Ok(()) };
        match result {
            Ok(state) if self.core.is_none() && state.is_member(&self.me) && state.cluster == token.cluster => {
                tracing::info!(cluster = %state.cluster, "joined with the join token");
                self.adopt(*state)?;
                self.provisional = Some(now + self.cfg.timing.confirm_ms);
                self.cfg.join_token = None;
                self.token_join.status = String::new();
                // Used up: a restart must not try it again.
                let file = self.cfg.data_dir.join(JOIN_TOKEN_FILE);
                if file.exists() {
                    if let Err(e) = std::fs::remove_file(&file) {
                        tracing::warn!("cannot delete {}: {e}", file.display());
                    }
                }
            }
            Ok(_) => {
                self.token_join.status = "the member answered without a usable cluster state".into();
                self.token_join.next = now + 5_000;
            }
            Err(e) if e == NO_OFFER => {
                self.token_join.status =
                    format!("no member of cluster {} discovered so far holds this token", token.cluster);
                self.token_join.next = now + 3_000;
            }
            // No member answered (a busy or restarting member, a lost packet): again soon.
            Err(e) if unreachable => {
                tracing::info!("joining with the join token: no member answered: {e}");
                self.token_join.status = format!("no member answered yet: {e}");
                self.token_join.next = now + 3_000;
            }
            Err(e) => {
                tracing::warn!("joining with the join token failed: {e}");
                self.token_join.status = format!("refused: {e}");
                self.token_join.next = now + 30_000;
            }
        }
        Ok(())
    }

    /// Where `node`'s join endpoint may be, best first: where a handshake proved its key
    /// before; on the address its main endpoint was reached at, the port of its first
    /// advert, then of its latest; then the latest advert's own address. A forged advert
    /// only adds a candidate that fails its handshake; it never hides the real one.
    fn join_candidates(&self, node: &NodeId) -> Vec<SocketAddr> {
        let mut out: Vec<SocketAddr> = lock(&self.join_addrs).get(node).copied().into_iter().collect();
        let main = lock(&self.addrs).get(node).copied();
        if let (Some(main), Some(port)) = (main, self.first_join_port.get(node)) {
            out.push(SocketAddr::new(main.ip(), *port));
        }
        if let Some((advert, ips)) = self.peers.get(node) {
            if let Some(main) = main {
                out.push(SocketAddr::new(main.ip(), advert.join_port));
            }
            if let Some(ip) = reachable(ips, self.main_addr) {
                out.push(SocketAddr::new(*ip, advert.join_port));
            }
        }
        let mut seen = HashSet::new();
        out.retain(|a| seen.insert(*a));
        out
    }

    /// Ask the members (on their join endpoints) whether this node is still one of them;
    /// a majority of the membership without this node must say no.
    fn check_revocation(&mut self, from: NodeId, rounds: u32) {
        let Some(core) = &self.core else { return };
        let cluster = core.state().cluster;
        let others: Vec<NodeId> = core.state().members.keys().filter(|m| **m != self.me).copied().collect();
        let need = others.len() / 2 + 1;
        let targets: Vec<(NodeId, Vec<SocketAddr>)> =
            others.iter().map(|m| (*m, self.join_candidates(m))).filter(|(_, a)| !a.is_empty()).collect();
        self.checking_revocation = true;
        let (open, tx, proven) = (self.open.clone(), self.tx.clone(), self.join_addrs.clone());
        tokio::spawn(async move {
            let mut confirmed = false;
            // The members learn of a commit a beat after the leader: a few rounds.
            for round in 0..rounds {
                if round > 0 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                let mut asks = tokio::task::JoinSet::new();
                for (node, addrs) in targets.clone() {
                    let (open, proven) = (open.clone(), proven.clone());
                    asks.spawn(async move {
                        let ask = join_request_any(&open, &addrs, node, &JoinRequest::AmIMember, &proven);
                        tokio::time::timeout(Duration::from_secs(10), ask).await
                    });
                }
                let mut no = 0;
                while let Some(done) = asks.join_next().await {
                    if let Ok(Ok(Ok(JoinResponse::Membership { cluster: c, member: false, .. }))) = done {
                        no += usize::from(c == cluster);
                    }
                }
                if no >= need {
                    confirmed = true;
                    break;
                }
            }
            let _ = tx.send(Input::RevocationChecked { from, confirmed }).await;
        });
    }

    /// Forget the cluster here without asking anyone (reset by the owner, or an approval
    /// that was never confirmed): unpaired, waiting for a code, a token or an approval.
    fn forget(&mut self, why: &str) -> Result<(), NodeError> {
        tracing::warn!("forgetting the cluster: {why}");
        blocking(|| self.store.remove(Space::Cluster, "state"))?;
        blocking(|| self.store.remove(Space::Cluster, "last"))?;
        self.unpaired(why);
        Ok(())
    }

    /// Drop the core and everything that depended on being a member.
    fn unpaired(&mut self, why: &str) {
        self.core = None;
        self.provisional = None;
        self.checking_revocation = false;
        lock(&self.public).cluster = None;
        self.sync_trust();
        self.advertise();
        let mut waiting: Vec<Proposal> = self.waiting.drain().map(|(_, p)| p).collect();
        waiting.extend(self.retry.drain(..).map(|(_, p)| p));
        for p in waiting {
            let me = self.me;
            match p.waiter {
                Waiter::Remove { node, reply } if node == me => {
                    let _ = reply.send(AdminResponse::Ok(format!("removed {node}; this node is unpaired now")));
                }
                Waiter::Approve { reply, .. } | Waiter::Remove { reply, .. } | Waiter::Put { reply, .. } => {
                    let _ = reply.send(AdminResponse::Error(format!("this node left the cluster: {why}")));
                }
                Waiter::Paired { .. } => {}
            }
        }
        // Not straight back into a cluster of our own: wait to be approved or paired.
        self.cfg.create = CreatePolicy::Never;
    }

    fn propose(&mut self, change: Change, waiter: Waiter) -> Result<(), NodeError> {
        let deadline = self.now() + PROPOSAL_MS;
        self.submit(Proposal { change, waiter, attempts: 0, deadline })
    }

    fn submit(&mut self, mut p: Proposal) -> Result<(), NodeError> {
        self.next_req += 1;
        let req = self.next_req;
        let change = p.change.clone();
        p.attempts += 1;
        self.waiting.insert(req, p);
        let now = self.now();
        let Some(core) = self.core.as_mut() else {
            // Left the cluster meanwhile.
            self.answer(req, Err(crate::core::ProposeError::NoLeader));
            return Ok(());
        };
        // Typed by what it writes: this node's own entries, the leader's placements,
        // else an owner's action (the only other way a change reaches here: the local
        // CLI, the admin page, an API call this node authorised; see `Proposal`).
        let actions = core.propose(now, req, crate::state::Proposal::of(&self.me, change));
        self.execute(actions)
    }

    /// Carry out the core's actions in order: a persist completes before anything after it.
    fn execute(&mut self, actions: Vec<Action>) -> Result<(), NodeError> {
        for action in actions {
            match action {
                Action::PersistHard(h) => blocking(|| self.store.put_json(Space::Election, "hard", &h))?,
                Action::PersistState(s) => blocking(|| self.store.put_json(Space::Cluster, "state", &*s))?,
                Action::Send { to, msg } => self.send(to, msg),
                Action::Reply { req, result } => self.answer(req, result),
                Action::Event(Event::State { version }) => {
                    tracing::debug!(%version, "cluster state");
                    self.sync_trust();
                }
                Action::Event(Event::Committed { version }) => {
                    tracing::debug!(%version, "committed");
                    let now: BTreeSet<NodeId> =
                        self.core.as_ref().map(|c| c.state().members.keys().copied().collect()).unwrap_or_default();
                    let before = std::mem::replace(&mut self.committed_members, now);
                    self.notify_removed(&before);
                }
                Action::Event(Event::Leader { leader, term }) => match leader {
                    Some(l) => tracing::info!(leader = %l, term, "leader"),
                    None => tracing::info!(term, "no leader"),
                },
                Action::Event(Event::Liveness { node, liveness }) => {
                    tracing::info!(%node, ?liveness, "member liveness")
                }
                Action::Event(Event::Removed) => self.leave()?,
            }
        }
        Ok(())
    }

    /// This node was removed: forget the cluster and wait, unpaired.
    fn leave(&mut self) -> Result<(), NodeError> {
        tracing::warn!("this node was removed from the cluster; it is unpaired now");
        if let Some(core) = &self.core {
            // Kept so that a welcome back can be checked against it (see `on_welcome`).
            blocking(|| self.store.put_json(Space::Cluster, "last", core.state()))?;
        }
        blocking(|| self.store.remove(Space::Cluster, "state"))?;
        self.unpaired("it was removed");
        Ok(())
    }

    /// The leader tells members whose removal just committed, on their join endpoint
    /// (their key no longer opens the main one).
    fn notify_removed(&mut self, before: &BTreeSet<NodeId>) {
        let Some(core) = &self.core else { return };
        if core.role() != &ElectionRole::Leader || before.is_empty() {
            return;
        }
        let gone: Vec<NodeId> =
            before.iter().filter(|id| !core.state().is_member(id) && **id != self.me).copied().collect();
        for node in gone {
            self.tell_revoked(node);
        }
    }

    /// Tell `node` on its join endpoint that it is no longer a member.
    fn tell_revoked(&self, node: NodeId) {
        let Some(core) = &self.core else { return };
        let addrs = self.join_candidates(&node);
        if addrs.is_empty() {
            return;
        }
        let (open, state, proven) = (self.open.clone(), Box::new(core.state().clone()), self.join_addrs.clone());
        tokio::spawn(async move {
            match join_request_any(&open, &addrs, node, &JoinRequest::Revoked { state }, &proven).await {
                Ok(JoinResponse::Accepted) => tracing::info!(%node, "removed node told"),
                Ok(other) => tracing::info!(%node, "removed node answered {other:?}"),
                Err(e) => tracing::info!(%node, "could not tell the removed node: {e}"),
            }
        });
    }

    fn answer(&mut self, req: u64, result: Result<crate::state::Version, crate::core::ProposeError>) {
        use crate::core::ProposeError as E;
        use crate::state::ChangeError;
        let Some(p) = self.waiting.remove(&req) else { return };
        // A retried approval that finds the node already in had committed before.
        let result = match (&p.change, result) {
            (Change::AddMember(_), Err(E::Invalid(ChangeError::AlreadyMember(_)))) if p.attempts > 1 => {
                Ok(self.core.as_ref().map(|c| c.state().version).unwrap_or_default())
            }
            (Change::RemoveMember(_), Err(E::Invalid(ChangeError::NotMember(_)))) if p.attempts > 1 => {
                Ok(self.core.as_ref().map(|c| c.state().version).unwrap_or_default())
            }
            (_, r) => r,
        };
        if let Err(E::NoLeader | E::Busy | E::Interrupted | E::Timeout) = &result {
            if self.now() + 500 < p.deadline && self.core.is_some() {
                self.retry.push((self.now() + 500, p));
                return;
            }
        }
        match (p.waiter, result) {
            (Waiter::Approve { node, reply }, Ok(_)) => {
                tracing::info!(%node, "approved");
                self.pending.remove(&node);
                let _ = reply.send(AdminResponse::Ok(format!("approved {node}")));
            }
            (Waiter::Remove { node, reply }, Ok(_)) if node == self.me => {
                // This node's own removal committed (`shoal leave`): the leader's notice
                // may never arrive (its links to us go with our key), so leave now.
                let _ = reply.send(AdminResponse::Ok(format!("removed {node}; this node is unpaired now")));
                self.leave_now = true;
            }
            (Waiter::Remove { node, reply }, Ok(_)) => {
                let _ = reply.send(AdminResponse::Ok(format!("removed {node}; its key is revoked")));
            }
            (Waiter::Paired { node }, Ok(_)) => tracing::info!(%node, "paired node approved"),
            (Waiter::Put { key, reply }, Ok(version)) => {
                let _ = reply.send(AdminResponse::Ok(format!("{key}: committed in the cluster state {version}")));
            }
            (Waiter::Approve { reply, .. } | Waiter::Remove { reply, .. } | Waiter::Put { reply, .. }, Err(e)) => {
                let _ = reply.send(AdminResponse::Error(e.to_string()));
            }
            (Waiter::Paired { node }, Err(e)) => tracing::warn!(%node, "a paired node could not be approved: {e}"),
        }
    }

    /// Send `state` (which lists it as a member) to a node on its join endpoint.
    fn welcome(&mut self, node: NodeId, state: ClusterState) {
        let Some((advert, ips)) = self.peers.get(&node) else { return };
        let Some(ip) = reachable(ips, self.main_addr) else { return };
        let addr = SocketAddr::new(*ip, advert.join_port);
        // Its main endpoint, for the membership link, until its new advert arrives.
        lock(&self.addrs).entry(node).or_insert(SocketAddr::new(*ip, advert.port));
        let state = Box::new(state);
        self.welcomed.insert(node, self.now());
        let open = self.open.clone();
        tokio::spawn(async move {
            match join_request(&open, addr, node, &JoinRequest::Welcome { state }).await {
                Ok(JoinResponse::Accepted) => tracing::info!(%node, "welcome taken"),
                Ok(other) => tracing::warn!(%node, "welcome refused: {other:?}"),
                Err(e) => tracing::info!(%node, "welcome not delivered yet: {e}"),
            }
        });
    }

    /// Every member re-sends the welcome to members that still advertise no cluster
    /// (the first one was lost, they restarted before taking it, or they were removed
    /// and approved again): without them a majority, and so a leader, may be impossible.
    fn welcome_approved(&mut self, now: u64) {
        let Some(core) = &self.core else { return };
        let due: Vec<NodeId> = self
            .peers
            .values()
            .filter(|(a, _)| a.cluster.is_none() && core.state().is_member(&a.node))
            .filter(|(a, _)| self.welcomed.get(&a.node).is_none_or(|t| now.saturating_sub(*t) > 3000))
            .map(|(a, _)| a.node)
            .collect();
        let state = core.state().clone();
        for node in due {
            self.welcome(node, state.clone());
        }
    }

    fn send(&mut self, to: NodeId, msg: crate::core::Msg) {
        // Tasks of links dropped since (members removed) are done: forget them.
        while self.link_tasks.try_join_next().is_some() {}
        let link = self.links.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(64);
            self.link_tasks.spawn(link_task(
                self.main.clone(),
                to,
                self.addrs.clone(),
                self.hints.clone(),
                rx,
                self.traffic.clone(),
            ));
            tx
        });
        // Best effort: a full queue means the member is unreachable; the protocol
        // tolerates loss and beats will carry on once it is back.
        let _ = link.try_send(msg);
    }

    fn on_discovery(&mut self, event: DiscoveryEvent) {
        match event {
            DiscoveryEvent::Found { advert, addrs } => {
                let Some(ip) = reachable(&addrs, self.main_addr).copied() else { return };
                let cluster = self.core.as_ref().map(|c| c.state().cluster);
                let revoked = self.core.as_ref().is_some_and(|c| c.state().revoked.contains(&advert.node));
                let leader = self.core.as_ref().is_some_and(|c| c.role() == &ElectionRole::Leader);
                if advert.cluster.is_some() && advert.cluster == cluster && revoked {
                    // Removed while it was away: the leader tells it once it shows up.
                    if leader && self.peers.get(&advert.node).is_none_or(|(old, _)| old.cluster != advert.cluster) {
                        self.peers.insert(advert.node, (advert.clone(), addrs.clone()));
                        self.tell_revoked(advert.node);
                    }
                } else if advert.cluster.is_some() && advert.cluster == cluster {
                    // A member: mDNS is only a hint. It gives the first address; after
                    // that, another address goes to the hints, and a link task uses it
                    // only if the known one fails and a handshake there proves the key.
                    let addr = SocketAddr::new(ip, advert.port);
                    let mut addrs = lock(&self.addrs);
                    match addrs.get(&advert.node) {
                        None => {
                            addrs.insert(advert.node, addr);
                        }
                        Some(known) if *known != addr => {
                            lock(&self.hints).insert(advert.node, addr);
                        }
                        Some(_) => {}
                    }
                    drop(addrs);
                    self.first_join_port.entry(advert.node).or_insert(advert.join_port);
                } else if advert.cluster.is_none() && cluster.is_some() {
                    self.verify(advert.node, SocketAddr::new(ip, advert.join_port));
                }
                if !self.peers.contains_key(&advert.node) && self.peers.len() >= MAX_PEERS && !self.make_room() {
                    // A flood of adverts (security review F15): the members' own and the
                    // pending nodes' stay; the rest is forgotten first.
                    return;
                }
                self.peers.insert(advert.node, (advert, addrs));
            }
            DiscoveryEvent::Lost { node } => {
                self.peers.remove(&node);
                self.pending.remove(&node);
                self.verifying.remove(&node);
                self.deferred.remove(&node);
            }
        }
    }

    /// Check the key of an unpaired node discovery reports, on its join endpoint, so it
    /// can be listed as pending; at most [`MAX_VERIFYING`] at once (the rest are tried
    /// again on a later tick: [`Self::verify_unpaired`]), and none for a node already
    /// pending, revoked, or while [`MAX_PENDING`] wait.
    fn verify(&mut self, node: NodeId, addr: SocketAddr) {
        let revoked = self.core.as_ref().is_some_and(|c| c.state().revoked.contains(&node));
        if revoked || self.verifying.contains(&node) || self.pending.contains_key(&node) {
            return;
        }
        if self.verifying.len() >= MAX_VERIFYING || self.pending.len() >= MAX_PENDING {
            if self.deferred.len() < MAX_PEERS {
                self.deferred.insert(node);
            }
            return;
        }
        self.deferred.remove(&node);
        self.verifying.insert(node);
        let (open, tx) = (self.open.clone(), self.tx.clone());
        tokio::spawn(async move {
            match join_request(&open, addr, node, &JoinRequest::Hello).await {
                Ok(JoinResponse::Info(info)) if info.node == node => {
                    let _ = tx.send(Input::Verified(info, addr)).await;
                }
                Ok(other) => {
                    tracing::warn!(%node, "unexpected answer to hello: {other:?}");
                    let _ = tx.send(Input::VerifyFailed(node)).await;
                }
                Err(e) => {
                    tracing::info!(%node, "could not verify a discovered node: {e}");
                    let _ = tx.send(Input::VerifyFailed(node)).await;
                }
            }
        });
    }

    /// The unpaired nodes whose verification waited for a place ([`Self::verify`]):
    /// verified now, as places allow (those discovery no longer reports, or that are
    /// in a cluster now, are dropped).
    fn verify_unpaired(&mut self) {
        if self.core.is_none() || self.verifying.len() >= MAX_VERIFYING || self.pending.len() >= MAX_PENDING {
            return;
        }
        let free = MAX_VERIFYING - self.verifying.len();
        let mut due = Vec::new();
        for node in std::mem::take(&mut self.deferred) {
            let Some((a, ips)) = self.peers.get(&node).filter(|(a, _)| a.cluster.is_none()) else { continue };
            let Some(ip) = reachable(ips, self.main_addr) else { continue };
            if due.len() < free {
                due.push((node, SocketAddr::new(*ip, a.join_port)));
            } else {
                self.deferred.insert(node);
            }
        }
        for (node, addr) in due {
            self.verify(node, addr);
        }
    }

    /// Forget one peer that is neither a member nor pending, to make room for another;
    /// whether there was one.
    fn make_room(&mut self) -> bool {
        let members = self.core.as_ref().map(|c| &c.state().members);
        let keep = |id: &NodeId| members.is_some_and(|m| m.contains_key(id)) || self.pending.contains_key(id);
        match spare(&self.peers, keep) {
            Some(id) => {
                self.peers.remove(&id);
                self.deferred.remove(&id);
                true
            }
            None => false,
        }
    }

    fn status(&self) -> ClusterStatus {
        let now = self.now();
        let (term, leader, role, version, members) = match &self.core {
            Some(core) => {
                let leader = core.leader();
                let members = core
                    .state()
                    .members
                    .values()
                    .map(|m| {
                        let advert = self.peers.get(&m.id).map(|(a, _)| a);
                        let mine = m.id == self.me;
                        MemberStatus {
                            node: m.id,
                            name: m.name.clone(),
                            role: m.role,
                            state: core.liveness(&m.id).unwrap_or(crate::core::Liveness::Down),
                            leader: leader == Some(m.id),
                            ram_available: if mine {
                                Some(self.inventory.ram_available_bytes)
                            } else {
                                advert.map(|a| a.ram_available)
                            },
                            vram_free: if mine {
                                Some(self.inventory.vram_free_bytes())
                            } else {
                                advert.map(|a| a.vram_free)
                            },
                            addr: if mine {
                                Some(self.main_addr.to_string())
                            } else {
                                lock(&self.addrs).get(&m.id).map(|a| a.to_string())
                            },
                        }
                    })
                    .collect();
                let role = match core.role() {
                    ElectionRole::Leader => "leader",
                    ElectionRole::Follower => "follower",
                    ElectionRole::PreCandidate | ElectionRole::Candidate => "candidate",
                    ElectionRole::Removed => "removed",
                };
                (core.term(), leader, role, core.state().version.to_string(), members)
            }
            None => (0, None, "unpaired", String::new(), Vec::new()),
        };
        ClusterStatus {
            node: self.me,
            name: self.cfg.name.clone(),
            addr: self.main_addr.to_string(),
            join_addr: self.open.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            cluster: self.core.as_ref().map(|c| c.state().cluster),
            term,
            leader,
            role: role.into(),
            version,
            members,
            pending: self
                .pending
                .values()
                .map(|(info, addr)| PendingStatus {
                    node: info.node,
                    name: info.name.clone(),
                    role: info.role,
                    memory_bytes: info.memory_bytes,
                    addr: addr.to_string(),
                })
                .collect(),
            pairing_s: self.offers.active(now).map(|until| until.saturating_sub(now) / 1000),
            tokens: self.tokens.active(unix_ms()),
            lan_clusters: if self.core.is_none() { self.lan_clusters() } else { Vec::new() },
            accepting: self.accepting.as_ref().filter(|_| self.core.is_none()).map(|a| a.member.clone()),
            join_token: self
                .cfg
                .join_token
                .as_ref()
                .filter(|_| self.core.is_none())
                .map(|t| format!("cluster {}: {}", t.cluster, self.token_join.status)),
            sent_msgs: self.traffic.msgs.load(Ordering::Relaxed),
            sent_bytes: self.traffic.bytes.load(Ordering::Relaxed),
            uptime_s: self.start.elapsed().as_secs_f64(),
        }
    }
}

/// Keeps a connection to one member and sends it membership messages, one uni stream
/// each; reconnects on demand with a growing pause while the member is unreachable.
async fn link_task(
    main: Arc<Node>,
    to: NodeId,
    addrs: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
    hints: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
    mut rx: mpsc::Receiver<crate::core::Msg>,
    traffic: Arc<Traffic>,
) {
    let mut conn: Option<quinn::Connection> = None;
    let mut retry_at = Instant::now();
    let mut backoff = Duration::from_millis(50);
    // The last message's stream: when the queue closes (the node stops), wait until the
    // member has it, or closing the endpoint could discard it.
    let mut last: Option<quinn::SendStream> = None;
    while let Some(msg) = rx.recv().await {
        if conn.as_ref().is_some_and(|c| c.close_reason().is_some()) {
            conn = None;
        }
        // The member moved (renumbered; `Actor::seen_at`): a connection to its old
        // address would swallow messages until QUIC's idle timeout.
        let moved = |c: &quinn::Connection| {
            lock(&addrs).get(&to).is_some_and(|a| canonical(*a) != canonical(c.remote_address()))
        };
        if let Some(c) = conn.take_if(|c| moved(c)) {
            tracing::info!(node = %to, "membership link: the member moved; connecting to its new address");
            c.close(0u32.into(), b"you moved");
        }
        if conn.is_none() {
            if Instant::now() < retry_at {
                continue; // dropped: beats repeat, the protocol tolerates loss
            }
            let known = lock(&addrs).get(&to).copied();
            let hint = lock(&hints).get(&to).copied().filter(|h| Some(*h) != known);
            let Some(addr) = known.or(hint) else { continue };
            let connect = |addr| tokio::time::timeout(Duration::from_secs(3), main.connect(addr, to, alpn::MEMBERSHIP));
            let mut attempt = connect(addr).await;
            // The known address failed: try the other one heard of. mDNS or a forged
            // advert can only suggest it; the handshake there proves the member's key
            // before it replaces the known one.
            if let (false, Some(hint), Some(_)) = (matches!(attempt, Ok(Ok(_))), hint, known) {
                attempt = connect(hint).await;
                if matches!(attempt, Ok(Ok(_))) {
                    tracing::info!(node = %to, %hint, "member reached at a new address");
                    lock(&addrs).insert(to, hint);
                    lock(&hints).remove(&to);
                }
            } else if known.is_none() && matches!(attempt, Ok(Ok(_))) {
                lock(&addrs).insert(to, addr);
                lock(&hints).remove(&to);
            }
            match attempt {
                Ok(Ok(c)) => {
                    conn = Some(c);
                    backoff = Duration::from_millis(50);
                }
                Ok(Err(e)) => {
                    tracing::debug!(node = %to, "membership link: {e}");
                    retry_at = Instant::now() + jitter(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
                Err(_) => {
                    retry_at = Instant::now() + jitter(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            }
        }
        let Some(c) = conn.as_ref() else { continue };
        let sent = async {
            let mut s = c.open_uni().await.map_err(|e| WireError::Stream(e.to_string()))?;
            write_msg(&mut s, &msg).await?;
            s.finish().map_err(|e| WireError::Stream(e.to_string()))?;
            Ok::<_, WireError>(s)
        };
        match tokio::time::timeout(Duration::from_secs(2), sent).await {
            Ok(Ok(s)) => {
                last = Some(s);
                traffic.msgs.fetch_add(1, Ordering::Relaxed);
                let size = serde_json::to_vec(&msg).map_or(0, |b| b.len() + 4);
                traffic.bytes.fetch_add(size as u64, Ordering::Relaxed);
            }
            _ => conn = None,
        }
    }
    if let Some(s) = last {
        // Bounded by the caller (`Actor::stop`).
        let _ = s.stopped().await;
    }
}

/// `addr` with an IPv4-mapped IPv6 address (a dual-stack socket's view of an IPv4
/// peer) written as IPv4, so that one place compares equal to itself.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// How often [`watch_addresses`] looks at this machine's addresses.
const ADDRESS_CHECK: Duration = Duration::from_secs(1);

/// Tell the actor when this machine's addresses change (a laptop back from sleep on a
/// new DHCP lease): polled, because no portable change notification exists and a
/// second's delay is small beside a reconnect. Ends with the actor.
async fn watch_addresses(tx: mpsc::Sender<Input>) {
    let current = || -> Option<BTreeSet<IpAddr>> {
        let ifs = if_addrs::get_if_addrs().ok()?;
        Some(ifs.into_iter().filter(|i| !i.is_loopback()).map(|i| i.ip()).collect())
    };
    let mut last = current();
    loop {
        tokio::time::sleep(ADDRESS_CHECK).await;
        let now = current();
        if now.is_none() || now == last {
            continue;
        }
        // Only an address that is new counts: one going away (a link down) leaves
        // nothing to tell, and the members keep dialling what they know.
        let gained = match (&last, &now) {
            (Some(before), Some(after)) => after.iter().any(|a| !before.contains(a)),
            _ => false,
        };
        last = now;
        if gained && tx.send(Input::Renumbered).await.is_err() {
            return;
        }
    }
}

/// Accept connections on the main endpoint: membership and link probes from members,
/// admin from the owner's CLI (which holds this node's own key) and, limited, from
/// members; anything else is closed.
async fn accept_main(main: Arc<Node>, router: Router, tx: mpsc::Sender<Input>) {
    let me = main.id();
    let (mut membership, mut probe, mut admin) =
        (router.route(alpn::MEMBERSHIP), router.route(alpn::PROBE), router.route(alpn::ADMIN));
    loop {
        let acc = tokio::select! {
            a = membership.accept() => a,
            a = probe.accept() => a,
            a = admin.accept() => a,
        };
        let Some(acc) = acc else { return };
        let tx = tx.clone();
        if acc.alpn == alpn::MEMBERSHIP && acc.peer != me {
            if tx.send(Input::Seen(acc.peer, acc.conn.remote_address())).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                while let Ok(mut recv) = acc.conn.accept_uni().await {
                    match read_msg(&mut recv).await {
                        Ok(Some(msg)) => {
                            // Where the member is now: QUIC moves a connection to the
                            // address a renumbered peer sends from (after validating the
                            // path), and that is a hint for reaching it again.
                            let now = acc.conn.remote_address();
                            if tx.send(Input::Member(acc.peer, msg, now)).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(peer = %acc.peer, "ignored a bad membership message: {e}"),
                    }
                }
            });
        } else if acc.alpn == alpn::PROBE && acc.peer != me {
            tokio::spawn(shoal_net::probe::serve(acc.conn));
        } else if acc.alpn == alpn::ADMIN {
            // The owner (this node's own key) may ask anything; other members (the only
            // other keys this endpoint accepts) may read and measure.
            let owner = acc.peer == me;
            tokio::spawn(async move {
                while let Ok((mut send, mut recv)) = acc.conn.accept_bi().await {
                    let answer = match read_msg::<AdminRequest>(&mut recv).await {
                        Ok(Some(req)) if !owner && !req.member_may() => {
                            AdminResponse::Error("only this node's owner may ask that".into())
                        }
                        Ok(Some(req)) => {
                            let (reply, rx) = oneshot::channel();
                            if tx.send(Input::Admin(req, reply)).await.is_err() {
                                return;
                            }
                            rx.await.unwrap_or(AdminResponse::Error("the node is stopping".into()))
                        }
                        Ok(None) => continue,
                        Err(e) => AdminResponse::Error(format!("bad request: {e}")),
                    };
                    let _ = write_msg(&mut send, &answer).await;
                    let _ = send.finish();
                }
            });
        } else {
            acc.conn.close(1u32.into(), b"protocol not served here");
        }
    }
}

/// Accept connections on the join endpoint: public facts, pairing, welcomes.
async fn accept_join(open: Arc<Node>, tx: mpsc::Sender<Input>, public: Arc<Mutex<PublicInfo>>, me: NodeId) {
    while let Some(acc) = open.accept().await {
        let (tx, public) = (tx.clone(), public.clone());
        tokio::spawn(async move {
            while let Ok((mut send, mut recv)) = acc.conn.accept_bi().await {
                let r = serve_join(&mut send, &mut recv, acc.peer, me, &tx, &public).await;
                if let Err(e) = r {
                    tracing::info!(peer = %acc.peer, "join protocol: {e}");
                }
                let _ = send.finish();
            }
        });
    }
}

async fn serve_join(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    peer: NodeId,
    me: NodeId,
    tx: &mpsc::Sender<Input>,
    public: &Mutex<PublicInfo>,
) -> Result<(), WireError> {
    // Strangers speak here: a bounded message, and a bounded wait for it.
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        crate::wire::read_msg_max::<JoinRequest>(recv, crate::wire::MAX_MESSAGE),
    );
    let Some(req) = first.await.map_err(|_| WireError::Stream("no request within 10 s".into()))?? else {
        return Ok(());
    };
    let stopping = || WireError::Stream("the node is stopping".into());
    match req {
        JoinRequest::Hello => {
            let info = lock(public).clone();
            write_msg(send, &JoinResponse::Info(info)).await
        }
        JoinRequest::Welcome { state } => {
            let (reply, rx) = oneshot::channel();
            tx.send(Input::Welcome { from: peer, state, reply }).await.map_err(|_| stopping())?;
            write_msg(send, &rx.await.map_err(|_| stopping())?).await
        }
        JoinRequest::PairStart { msg, mut info, token } => {
            // The key is the one the joiner proved in the handshake, whatever it claims.
            info.node = peer;
            let token_id = token.as_deref().and_then(|t| t.parse::<TokenId>().ok());
            let (reply, rx) = oneshot::channel();
            tx.send(Input::PairBegin { token, reply }).await.map_err(|_| stopping())?;
            let code = match rx.await.map_err(|_| stopping())? {
                Ok(code) => code,
                Err(PairError::NoOffer) => return write_msg(send, &JoinResponse::NoOffer).await,
                Err(e) => return write_msg(send, &JoinResponse::Error(e.to_string())).await,
            };
            let done = |ok: bool, info: PublicInfo| async move {
                let (reply, rx) = oneshot::channel();
                tx.send(Input::PairDone { ok, info, token: token_id, reply }).await.map_err(|_| stopping())?;
                rx.await.map_err(|_| stopping())
            };
            let (responder, first) = match Responder::respond(&code, peer, me, &msg) {
                Ok(r) => r,
                Err(e) => {
                    done(false, info).await?;
                    return write_msg(send, &JoinResponse::Error(e.to_string())).await;
                }
            };
            write_msg(send, &JoinResponse::PairReply { msg: first }).await?;
            let confirm = tokio::time::timeout(Duration::from_secs(30), read_msg::<JoinRequest>(recv)).await;
            let ok = match confirm {
                Ok(Ok(Some(JoinRequest::PairConfirm { msg }))) => responder.confirm(&msg).is_ok(),
                _ => false,
            };
            let answer = done(ok, info).await?;
            write_msg(send, &answer).await
        }
        JoinRequest::Revoked { state } => {
            let (reply, rx) = oneshot::channel();
            tx.send(Input::Revoked { from: peer, state, reply }).await.map_err(|_| stopping())?;
            write_msg(send, &rx.await.map_err(|_| stopping())?).await
        }
        JoinRequest::AmIMember => {
            let (reply, rx) = oneshot::channel();
            tx.send(Input::AmIMember { peer, reply }).await.map_err(|_| stopping())?;
            write_msg(send, &rx.await.map_err(|_| stopping())?).await
        }
        JoinRequest::PairConfirm { .. } => {
            write_msg(send, &JoinResponse::Error("no pairing exchange under way".into())).await
        }
    }
}

/// One request/response on a node's join endpoint.
async fn join_request(open: &Node, addr: SocketAddr, node: NodeId, req: &JoinRequest) -> Result<JoinResponse, String> {
    let conn = tokio::time::timeout(Duration::from_secs(5), open.connect(addr, node, alpn::JOIN))
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
        .map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    write_msg(&mut send, req).await.map_err(|e| e.to_string())?;
    let answer = tokio::time::timeout(Duration::from_secs(30), read_msg::<JoinResponse>(&mut recv))
        .await
        .map_err(|_| "no answer within 30 s".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or("the node closed the stream without answering")?;
    conn.close(0u32.into(), b"done");
    Ok(answer)
}

/// [`join_request`] to the first of `addrs` where the handshake proves `node`'s key;
/// that address is remembered in `proven` for next time.
async fn join_request_any(
    open: &Node,
    addrs: &[SocketAddr],
    node: NodeId,
    req: &JoinRequest,
    proven: &Mutex<HashMap<NodeId, SocketAddr>>,
) -> Result<JoinResponse, String> {
    let mut last = String::from("no address known");
    for addr in addrs {
        match join_request(open, *addr, node, req).await {
            Ok(answer) => {
                lock(proven).insert(node, *addr);
                return Ok(answer);
            }
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(last)
}

/// Pair with `code` (or a token), trying the members in `targets` until one holds an
/// offer. Each member gets its own time limits: one that accepts and then stalls, or
/// answers nonsense, costs at most a few seconds before the next is tried.
async fn join_with_code(
    open: &Node,
    code: &JoinSecret,
    info: PublicInfo,
    targets: &[(NodeId, SocketAddr)],
) -> Result<Box<ClusterState>, String> {
    join_attempt(open, code, info, targets).await.map_err(|(e, _)| e)
}

/// [`join_with_code`], its error with whether a member answered (a refusal, a wrong
/// secret, no offer) rather than none being reached.
async fn join_attempt(
    open: &Node,
    code: &JoinSecret,
    info: PublicInfo,
    targets: &[(NodeId, SocketAddr)],
) -> Result<Box<ClusterState>, (String, bool)> {
    // What a member that held an offer said (a wrong code, a pause to respect) matters
    // more to the user than members that could not be reached.
    let (mut answered, mut unreachable): (Option<String>, Option<String>) = (None, None);
    for (member, addr) in targets {
        let attempt = pair_with(open, code, info.clone(), *member, *addr);
        match tokio::time::timeout(Duration::from_secs(45), attempt).await {
            Ok(PairOutcome::Joined(state)) => return Ok(state),
            Ok(PairOutcome::Final(e)) => return Err((e, true)),
            Ok(PairOutcome::NoOffer) => {}
            Ok(PairOutcome::Next(e)) => answered = Some(e),
            Ok(PairOutcome::Unreachable(e)) => unreachable = Some(e),
            Err(_) => unreachable = Some(format!("{member} did not finish the exchange in 45 s")),
        }
    }
    match (answered, unreachable) {
        (Some(e), _) => Err((e, true)),
        (None, Some(e)) => Err((e, false)),
        (None, None) => Err((NO_OFFER.to_string(), true)),
    }
}

/// How one pairing attempt with one member ended.
enum PairOutcome {
    /// Joined: the state to start from.
    Joined(Box<ClusterState>),
    /// The member holds no offer: try the next one.
    NoOffer,
    /// This member answered but it did not work (wrong secret for it, a pause to
    /// respect, nonsense): try the next one, and report this if none succeeds.
    Next(String),
    /// This member could not be reached or did not answer: try the next one.
    Unreachable(String),
    /// The exchange succeeded but the member refused afterwards: stop.
    Final(String),
}

async fn pair_with(open: &Node, code: &JoinSecret, info: PublicInfo, member: NodeId, addr: SocketAddr) -> PairOutcome {
    let io = |e: &dyn std::fmt::Display| PairOutcome::Unreachable(format!("{member}: {e}"));
    let conn = match tokio::time::timeout(Duration::from_secs(5), open.connect(addr, member, alpn::JOIN)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return io(&e),
        Err(_) => return io(&"no connection within 5 s"),
    };
    let (mut send, mut recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return io(&e),
    };
    let (joiner, first) = Joiner::start(code, open.id(), member);
    let start = JoinRequest::PairStart { msg: first, info, token: code.token_id() };
    if let Err(e) = write_msg(&mut send, &start).await {
        return io(&e);
    }
    let reply = match tokio::time::timeout(Duration::from_secs(10), read_msg::<JoinResponse>(&mut recv)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return io(&e),
        Err(_) => return io(&"no reply within 10 s"),
    };
    match reply {
        Some(JoinResponse::PairReply { msg }) => {
            // A wrong code here may be right at another member (another cluster, or an
            // older code): go on, and report the failure only if none takes it.
            let confirmation = match joiner.finish(&msg) {
                Ok(c) => c,
                Err(e) => return PairOutcome::Next(e.to_string()),
            };
            if let Err(e) = write_msg(&mut send, &JoinRequest::PairConfirm { msg: confirmation }).await {
                return io(&e);
            }
            let answer = tokio::time::timeout(Duration::from_secs(30), read_msg::<JoinResponse>(&mut recv)).await;
            conn.close(0u32.into(), b"done");
            match answer {
                Ok(Ok(Some(JoinResponse::Joined { state }))) => PairOutcome::Joined(state),
                Ok(Ok(Some(JoinResponse::Error(e)))) => PairOutcome::Final(e),
                Ok(Ok(other)) => PairOutcome::Final(format!("unexpected answer: {other:?}")),
                Ok(Err(e)) => PairOutcome::Final(e.to_string()),
                Err(_) => PairOutcome::Final("no answer from the member within 30 s".into()),
            }
        }
        Some(JoinResponse::NoOffer) => PairOutcome::NoOffer,
        Some(JoinResponse::Error(e)) => PairOutcome::Next(e),
        other => PairOutcome::Next(format!("unexpected answer: {other:?}")),
    }
}

/// What pairing reports when no member discovered so far holds a code (retried).
const NO_OFFER: &str =
    "no member of a cluster on the LAN holds a pairing code: run `shoal nodes pair` on one (or wait for discovery)";

/// Probe the links to `peers`, one after the other (transfers at once would share the
/// uplink and time each other); the value kept as `links/<this node>`.
async fn probe_links(
    main: &Node,
    peers: &[(NodeId, SocketAddr)],
    frame_bytes: u32,
) -> Result<serde_json::Value, String> {
    let opts = shoal_net::ProbeOptions { frame_bytes, ..shoal_net::ProbeOptions::default() };
    let mut out = BTreeMap::new();
    let mut failed = Vec::new();
    for (id, addr) in peers.iter().copied() {
        let measured = async {
            let conn = tokio::time::timeout(Duration::from_secs(5), main.connect(addr, id, alpn::PROBE))
                .await
                .map_err(|_| "no connection within 5 s".to_string())?
                .map_err(|e| e.to_string())?;
            let m = shoal_net::probe::measure(&conn, &opts).await.map_err(|e| e.to_string());
            conn.close(0u32.into(), b"done");
            m
        };
        match tokio::time::timeout(Duration::from_secs(60), measured).await.unwrap_or(Err("timeout".into())) {
            Ok(m) => {
                out.insert(id.to_string(), m);
            }
            Err(e) => {
                tracing::warn!(node = %id, "link probe failed: {e}");
                failed.push(format!("{id}: {e}"));
            }
        }
    }
    if out.is_empty() {
        return Err(format!("no link could be probed: {}", failed.join("; ")));
    }
    serde_json::to_value(LinksEntry { frame_bytes, peers: out }).map_err(|e| e.to_string())
}

/// What `links/<node>` holds: the links from that node to the others it probed.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinksEntry {
    /// Frame size probed, bytes.
    pub frame_bytes: u32,
    /// By peer id (hex).
    pub peers: BTreeMap<String, shoal_net::LinkMeasure>,
}

impl LinksEntry {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "links/";

    /// The key of what `node` measured: `links/<node id>`.
    pub fn key(node: &NodeId) -> String {
        format!("{}{node}", Self::KEY_PREFIX)
    }

    /// What this entry says of the link to `peer`, if it probed it.
    pub fn to(&self, peer: &NodeId) -> Option<&shoal_net::LinkMeasure> {
        self.peers.get(&peer.to_string())
    }
}

/// Ask the node whose data directory is `data_dir` (this machine) to do `req`, as its
/// owner: the CLI holds the node's own key, which the node always trusts.
pub async fn admin(data_dir: &Path, identity: Arc<Identity>, req: &AdminRequest) -> Result<AdminResponse, NodeError> {
    let path = data_dir.join(ENDPOINT_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| NodeError::Io { path: path.clone(), source })?;
    let mut addr: SocketAddr =
        text.trim().parse().map_err(|_| NodeError::Admin(format!("{}: not an address: {text:?}", path.display())))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(if addr.is_ipv4() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
        });
    }
    let me = identity.id();
    admin_at(addr, me, identity, req).await.map_err(|e| match e {
        NodeError::Admin(e) => {
            NodeError::Admin(format!("{e} (address from {}; is `shoal serve` running?)", path.display()))
        }
        e => e,
    })
}

/// Ask node `node` at `addr` to do `req`, holding `identity`: this node's own key (the
/// owner: anything) or a fellow member's (what [`AdminRequest::member_may`] allows).
pub async fn admin_at(
    addr: SocketAddr,
    node: NodeId,
    identity: Arc<Identity>,
    req: &AdminRequest,
) -> Result<AdminResponse, NodeError> {
    let any: SocketAddr = if addr.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    let client = Node::bind(any, identity, TrustedKeys::new([node]), &TransportOptions::default())?;
    let down = |e: &dyn std::fmt::Display| NodeError::Admin(format!("the node at {addr} does not answer: {e}"));
    let conn = tokio::time::timeout(Duration::from_secs(5), client.connect(addr, node, alpn::ADMIN))
        .await
        .map_err(|_| down(&"timeout"))?
        .map_err(|e| down(&e))?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| down(&e))?;
    write_msg(&mut send, req).await.map_err(|e| down(&e))?;
    let _ = send.finish();
    let patience = req.patience();
    let answer = tokio::time::timeout(patience, read_msg::<AdminResponse>(&mut recv))
        .await
        .map_err(|_| NodeError::Admin(format!("no answer from {addr} within {} s", patience.as_secs())))?
        .map_err(|e| down(&e))?
        .ok_or_else(|| NodeError::Admin("the node closed the stream without answering".into()))?;
    conn.close(0u32.into(), b"done");
    client.close();
    Ok(answer)
}

/// `shoal reset` while the node is stopped: forget the cluster stored in `data_dir`
/// (and the tokens made there); with `new_key`, also the node's key and election state,
/// so that it starts as a new node. Fails if the node runs (its store is locked).
pub fn reset_offline(data_dir: &Path, new_key: bool) -> Result<String, NodeError> {
    let store = SledStore::open(data_dir)?;
    let cluster = store.get_json::<ClusterState>(Space::Cluster, "state")?.map(|s| s.cluster);
    store.remove(Space::Cluster, "state")?;
    store.remove(Space::Cluster, "last")?;
    store.remove(Space::Node, TOKENS_KEY)?;
    let mut text = match cluster {
        Some(c) => format!("this node forgot cluster {c}; it starts unpaired"),
        None => "this node held no cluster; it starts unpaired".to_string(),
    };
    if new_key {
        // A new key is a new node: its old term and vote mean nothing to anyone.
        store.remove(Space::Election, "hard")?;
        drop(store);
        let key = data_dir.join(shoal_net::identity::KEY_FILE);
        match std::fs::remove_file(&key) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(NodeError::Io { path: key, source }),
        }
        shoal_net::identity::sync_dir(data_dir).map_err(|source| NodeError::Io { path: data_dir.into(), source })?;
        text.push_str(" with a new key (a new node id) at its next start");
    }
    Ok(text)
}

fn write_endpoint(dir: &Path, addr: SocketAddr) -> Result<(), NodeError> {
    let path = dir.join(ENDPOINT_FILE);
    std::fs::write(&path, format!("{addr}\n")).map_err(|source| NodeError::Io { path, source })
}

/// The node whose id is `prefix` or starts with it, if exactly one.
fn find<'a>(prefix: &str, ids: impl Iterator<Item = &'a NodeId>) -> Result<NodeId, String> {
    let prefix = prefix.trim().to_ascii_lowercase();
    if prefix.is_empty() {
        return Err("no node id given".into());
    }
    let hits: Vec<NodeId> = ids.filter(|id| id.to_string().starts_with(&prefix)).copied().collect();
    match hits.as_slice() {
        [one] => Ok(*one),
        [] => Err(format!("no node {prefix}")),
        _ => Err(format!("{prefix} matches {} nodes; give more digits", hits.len())),
    }
}

fn memory_of(inv: &NodeInventory) -> u64 {
    inv.ram_total_bytes + inv.gpus.iter().map(|g| g.total_bytes).sum::<u64>()
}

/// Run a store write (it fsyncs) off the async worker: on the multi-threaded runtime
/// `block_in_place` hands this worker's other tasks (link tasks carrying beats, accept
/// loops) to another thread while the disk is slow. The actor itself waits, which keeps
/// the order the core needs (a vote is stored before the reply that depends on it).
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock means a panic elsewhere mid-update of plain data; still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A peer that may be forgotten to make room for another: any that `keep` does not
/// hold on to (members, pending nodes); `None` when all are kept.
fn spare<V>(peers: &HashMap<NodeId, V>, keep: impl Fn(&NodeId) -> bool) -> Option<NodeId> {
    peers.keys().find(|id| !keep(id)).copied()
}

/// The first of a peer's advertised addresses this node's endpoints can reach: one of
/// the same family (an endpoint bound to IPv4 cannot dial `::1`), else the first.
fn reachable(ips: &[IpAddr], local: SocketAddr) -> Option<&IpAddr> {
    ips.iter().find(|ip| ip.is_ipv4() == local.is_ipv4() || local.ip().is_unspecified() && local.is_ipv6())
}

/// Wall-clock time (Unix, ms): for what outlives a restart (join tokens' expiry).
fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn fill_random(buf: &mut [u8]) {
    // Invariant: the OS random source is available on every platform Shoal runs on.
    getrandom::getrandom(buf).expect("the OS random source works");
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    fill_random(&mut b);
    u64::from_le_bytes(b)
}

fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + (random_u64() % 1000) as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_found_by_unique_prefix() {
        let ids = [NodeId([0xab; 32]), NodeId([0xac; 32])];
        assert_eq!(find("abab", ids.iter()), Ok(ids[0]));
        assert!(find("a", ids.iter()).unwrap_err().contains("2 nodes"));
        assert!(find("ff", ids.iter()).is_err());
        assert!(find("", ids.iter()).is_err());
    }

    /// Security review F15: adverts of made-up ids fill the table to its bound, churn
    /// through it, and never push out a member or a pending node.
    #[test]
    fn a_flood_of_adverts_never_pushes_out_members_or_pending_nodes() {
        let (member, pending) = (NodeId([1; 32]), NodeId([2; 32]));
        let keep = |id: &NodeId| *id == member || *id == pending;
        let mut peers: HashMap<NodeId, ()> = HashMap::from([(member, ()), (pending, ())]);
        for k in 0..5000u32 {
            let mut b = [9u8; 32];
            b[..4].copy_from_slice(&k.to_le_bytes());
            if peers.len() >= MAX_PEERS {
                let out = spare(&peers, keep).expect("room among the flood");
                assert!(!keep(&out));
                peers.remove(&out);
            }
            peers.insert(NodeId(b), ());
            assert!(peers.len() <= MAX_PEERS);
        }
        assert!(peers.contains_key(&member) && peers.contains_key(&pending));
        // When everything held is kept, a newcomer finds no room.
        assert_eq!(spare(&HashMap::from([(member, ())]), |_| true), None);
    }
}
