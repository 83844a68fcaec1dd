//! `shoal-lab bench soak`: hours of home WiFi against a real cluster. Plain `shoal
//! serve` nodes, each on a namespace host of its own, joined with pairing codes; the
//! test model added on one and placed by the leader; on every host a client streams
//! greedy chat completions through its own node's API (loopback, as an app on that
//! machine would) while a seeded schedule injects one fault at a time: WiFi drops
//! (the host's link down 1-20 s), loss bursts (10-30% for 3-10 s), lids (the node's
//! process stopped 5-20 s, then continued), crashes (SIGKILL, restarted 0.5-3 s
//! later; the leader's too) and renumbers (the host gets a new address, as DHCP
//! gives a laptop back from sleep). Each answer is compared with the same request's
//! answer before any fault. Prints requests, tokens, faults by kind, answers changed,
//! requests failed, the longest stall between two streamed tokens, the stall time
//! each kind of fault caused, and each kind's "healed → next token" (for the streams
//! the fault had stalled). Fails (after the table) when an answer changed or a
//! request failed: both must be 0.

use super::median;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};
use shoal::local::Lab;
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_node::api::NodeRequest;
use shoal_testnet::Rng;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `shoal-lab bench soak`.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long faults are injected, hours (0.05: three minutes).
    #[arg(long, default_value_t = 1.0)]
    hours: f64,
    /// Nodes, each on a namespace host with a client of its own.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Seed of the fault schedule and the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds between one fault's healing and the next fault: a random value between
    /// this and twice it.
    #[arg(long, default_value_t = 8.0)]
    gap_s: f64,
    /// Memory each node offers, MiB (so that the model splits).
    #[arg(long, default_value_t = 90)]
    max_memory_mib: u64,
    /// The GGUF model [default: the test model].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Only these kinds of fault (comma-separated: wifi-drop, loss-burst, lid, crash,
    /// leader-crash, renumber) [default: all, in the usual mix].
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<Kind>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The kinds of fault, as the table names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
enum Kind {
    WifiDrop,
    LossBurst,
    Lid,
    Crash,
    LeaderCrash,
    Renumber,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::WifiDrop => "wifi drop",
            Kind::LossBurst => "loss burst",
            Kind::Lid => "lid",
            Kind::Crash => "crash",
            Kind::LeaderCrash => "leader crash",
            Kind::Renumber => "renumber",
        }
    }
}

/// One injected fault.
#[derive(Debug)]
struct Fault {
    kind: Kind,
    /// The host (node `n<host>`) it hit.
    host: usize,
    /// When it began.
    start: Instant,
    /// When it was over: the link up, the loss rule gone, the process continued or
    /// started again, the new address in place.
    healed: Instant,
    /// Its size, for the log ("4.2 s", "20%", "10.200.3.101").
    detail: String,
}

/// A prompt, a length, and sampling: greedy (`None`) or a temperature and seed.
type Ask = (&'static str, u32, Option<(f32, i64)>);

/// The requests clients choose from: a prompt, a length, and sampling (greedy, or
/// seeded sampling: both must give the same answer every time).
const REQUESTS: &[Ask] = &[
    ("Write a short story about a lighthouse keeper.", 96, None),
    ("Explain how a bicycle stays upright.", 64, None),
    ("List five uses for a paperclip.", 48, None),
    ("What is the capital of France, and why is it famous?", 80, Some((0.8, 7))),
    ("Describe the sea at night.", 128, Some((0.7, 42))),
    ("Give me three tips for learning to cook.", 72, None),
];

/// Ask no more than this of a stream: a generation that has not ended by then counts
/// as failed (the API's own bound on a stall is well under it).
const REQUEST_LIMIT: Duration = Duration::from_secs(600);

/// A gap between two streamed tokens longer than this is a stall (a token takes tens
/// of milliseconds here).
const STALL: Duration = Duration::from_secs(1);

/// How long after its restart a node's API may refuse connections (the process
/// starting) without that counting as a failed request.
const OWN_RESTART: Duration = Duration::from_secs(30);

/// One request, as its client saw it.
#[derive(Debug)]
struct Request {
    /// Index into [`REQUESTS`].
    which: usize,
    /// The host of the client (and of the node whose API it called).
    host: usize,
    sent: Instant,
    /// When each piece of text arrived.
    times: Vec<Instant>,
    /// The text, in order.
    text: String,
    /// Completion tokens the usage chunk counted.
    tokens: u64,
    /// Why it failed, if it did.
    failed: Option<String>,
    /// When its answer ended (or failed).
    ended: Instant,
}

pub fn soak(a: SoakArgs) -> Result<()> {
    if a.nodes < 2 {
        bail!("a soak needs at least 2 nodes");
    }
    let model = super::node::model_or_default(&a.model)?;
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    eprintln!("[soak] {} nodes on namespace hosts, {} MiB each …", a.nodes, a.max_memory_mib);
    let mut lab = Lab::start_on_hosts(a.nodes, a.max_memory_mib, &[])?;
    lab.ask("n0", NodeRequest::ModelAdd { path: model.display().to_string(), name: None })?;
    let sessions = a.nodes as u32;
    lab.ask("n1", NodeRequest::ModelLoad { model: name.clone(), context: 512, sessions, exclude: vec![] })?;
    let (placement, stages) = lab.running(&name, 0)?;
    let layout: Vec<String> = stages.iter().map(|(n, st)| format!("{n} {}", st.layers)).collect();
    eprintln!("[soak] placed in {} stages: {}", placement.stages.len(), layout.join(", "));
    let net = lab.net().context("a soak runs on namespace hosts")?;
    let namespaces: Vec<String> = (0..a.nodes).map(|k| net.namespace(k).to_string()).collect();
    let port: std::net::SocketAddr = std::fs::read_to_string(lab.dir("n0").join(shoal_node::http::HTTP_FILE))
        .context("n0 serves no API")?
        .trim()
        .parse()?;
    let port = port.port();

    // Every request's answer before any fault, through n0's API.
    let mut reference = Vec::new();
    for which in 0..REQUESTS.len() {
        let r = on_host(&namespaces[0], || Ok(stream(port, &name, which, 0)))?;
        if let Some(e) = &r.failed {
            bail!("the reference answer to request {which} failed: {e}");
        }
        reference.push(r.text);
    }
    eprintln!("[soak] {} reference answers taken; clients start", reference.len());

    // Clients, one per host, until `stop`.
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<Mutex<Vec<Request>>> = Arc::default();
    let mut clients = Vec::new();
    for (host, ns) in namespaces.iter().enumerate() {
        let (stop, done, ns, name) = (stop.clone(), done.clone(), ns.clone(), name.clone());
        let mut rng = Rng::new(a.seed.wrapping_mul(1000).wrapping_add(host as u64 + 1));
        clients.push(std::thread::spawn(move || {
            on_host(&ns, || {
                while !stop.load(Ordering::Relaxed) {
                    let which = rng.below(REQUESTS.len() as u64) as usize;
                    let r = stream(port, &name, which, host);
                    if let Some(e) = &r.failed {
                        eprintln!("[soak] a request through n{host} failed: {e}");
                    }
                    done.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    std::thread::sleep(Duration::from_secs_f64(rng.float(0.0, 2.0)));
                }
                Ok(())
            })
        }));
    }

    // The fault schedule, one fault at a time.
    let mut rng = Rng::new(a.seed);
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(a.hours * 3600.0);
    let mut faults = Vec::new();
    while Instant::now() < until {
        std::thread::sleep(Duration::from_secs_f64(rng.float(a.gap_s, 2.0 * a.gap_s)));
        let f = inject(&mut lab, &mut rng, a.nodes, &a.only)?;
        eprintln!(
            "[soak] {:>7.1} s  {:<12} n{} {}",
            f.start.duration_since(t0).as_secs_f64(),
            f.kind.label(),
            f.host,
            f.detail
        );
        faults.push(f);
    }
    eprintln!("[soak] faults over; waiting for the clients' last requests");
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        match c.join() {
            Ok(r) => r?,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    let requests = std::mem::take(&mut *done.lock().unwrap_or_else(|p| p.into_inner()));
    let figures = figures(&requests, &reference, &faults, t0.elapsed());
    if a.json {
        println!("{}", serde_json::to_string_pretty(&figures)?);
    } else {
        print_table(&figures, &a, placement.stages.len());
    }
    if figures.answers_changed > 0 || figures.requests_failed > 0 {
        bail!(
            "{} answer(s) changed and {} request(s) failed under faults (both must be 0)",
            figures.answers_changed,
            figures.requests_failed
        );
    }
    Ok(())
}

/// Run `f` on a thread of its own inside network namespace `ns` (a host's): its
/// sockets are that host's. Unlike [`shoal_testnet::Net::within`] it needs no borrow
/// of the hosts, which the fault schedule changes meanwhile.
fn on_host<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    use std::os::fd::AsRawFd;
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns(2) on an open namespace file; it moves only this thread,
            // which ends after `f`.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("entering {path}: {}", std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Inject one fault and wait until it is over.
fn inject(lab: &mut Lab, rng: &mut Rng, nodes: usize, only: &[Kind]) -> Result<Fault> {
    let mut host = rng.below(nodes as u64) as usize;
    let kind = match rng.below(100) {
        _ if !only.is_empty() => only[rng.below(only.len() as u64) as usize],
        0..30 => Kind::WifiDrop,
        30..45 => Kind::LossBurst,
        45..60 => Kind::Lid,
        60..75 => Kind::Crash,
        75..85 => Kind::LeaderCrash,
        _ => Kind::Renumber,
    };
    if kind == Kind::LeaderCrash {
        host = leader(lab, nodes)?;
    }
    let node = format!("n{host}");
    let start = Instant::now();
    let net_err = |e: shoal_testnet::NetnsError| anyhow::anyhow!("{e}");
    let detail = match kind {
        Kind::WifiDrop => {
            let d = rng.float(1.0, 20.0);
            lab.net().context("no hosts")?.link(host, false).map_err(net_err)?;
            std::thread::sleep(Duration::from_secs_f64(d));
            lab.net().context("no hosts")?.link(host, true).map_err(net_err)?;
            format!("{d:.1} s")
        }
        Kind::LossBurst => {
            let (p, d) = (rng.below(21) as u32 + 10, rng.float(3.0, 10.0));
            lab.net().context("no hosts")?.loss(host, p).map_err(net_err)?;
            std::thread::sleep(Duration::from_secs_f64(d));
            lab.net().context("no hosts")?.loss(host, 0).map_err(net_err)?;
            format!("{p}% for {d:.1} s")
        }
        Kind::Lid => {
            let d = rng.float(5.0, 20.0);
            lab.freeze(&node, true)?;
            std::thread::sleep(Duration::from_secs_f64(d));
            lab.freeze(&node, false)?;
            format!("{d:.1} s")
        }
        Kind::Crash | Kind::LeaderCrash => {
            let d = rng.float(0.5, 3.0);
            lab.kill(&node);
            std::thread::sleep(Duration::from_secs_f64(d));
            lab.restart(&node)?;
            format!("down {d:.1} s")
        }
        Kind::Renumber => {
            let (old, new) = {
                let net = lab.net_mut().context("no hosts")?;
                (net.addr(host), net.renumber(host).map_err(net_err)?)
            };
            format!("{old} -> {new}")
        }
    };
    Ok(Fault { kind, host, start, healed: Instant::now(), detail })
}

/// The host of the node most nodes name as their leader.
fn leader(lab: &Lab, nodes: usize) -> Result<usize> {
    let mut votes: BTreeMap<String, usize> = BTreeMap::new();
    for k in 0..nodes {
        if let Ok(AdminResponse::Status(s)) = lab.admin(&format!("n{k}"), AdminRequest::Status) {
            if let Some(l) = s.leader {
                *votes.entry(l.to_string()).or_default() += 1;
            }
        }
    }
    let id = votes.into_iter().max_by_key(|(_, v)| *v).map(|(id, _)| id).context("no node names a leader")?;
    (0..nodes)
        .find(|k| lab.id_of(&format!("n{k}")).ok().as_deref() == Some(&id))
        .context("the leader is not a lab node")
}

/// One streamed chat request of kind `which` to the API on this host's loopback.
fn stream(port: u16, model: &str, which: usize, host: usize) -> Request {
    let (prompt, n, sampling) = REQUESTS[which];
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    match sampling {
        None => body["temperature"] = json!(0),
        Some((t, seed)) => {
            body["temperature"] = json!(t);
            body["seed"] = json!(seed);
        }
    }
    let now = Instant::now();
    let mut r =
        Request { which, host, sent: now, times: Vec::new(), text: String::new(), tokens: 0, failed: None, ended: now };
    if let Err(e) = read_stream(port, &body, &mut r) {
        r.failed = Some(format!("{e:#}"));
    }
    r.ended = Instant::now();
    r
}

/// Send `body` and read its SSE answer into `r`.
fn read_stream(port: u16, body: &Value, r: &mut Request) -> Result<()> {
    use std::io::BufRead;
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(REQUEST_LIMIT)).build().into();
    let mut resp = agent
        .post(&format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())?;
    if resp.status() != 200 {
        bail!("the API answered {}: {}", resp.status(), resp.body_mut().read_to_string().unwrap_or_default().trim());
    }
    for line in std::io::BufReader::new(resp.body_mut().as_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).context("a malformed chunk")?;
        if let Some(e) = v.get("error") {
            bail!("the stream ended with an error: {e}");
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
            r.times.push(Instant::now());
            r.text.push_str(t);
        }
        r.tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(r.tokens);
    }
    bail!("the stream ended without [DONE]")
}

/// What the soak measured.
#[derive(Debug, Serialize)]
struct Figures {
    duration_s: f64,
    requests: usize,
    tokens: u64,
    answers_changed: usize,
    /// Requests that failed, less those whose own API node was killed under them.
    requests_failed: usize,
    /// Requests cut because the node whose API they called was SIGKILLed meanwhile.
    ended_by_own_node_crash: usize,
    /// Each fault and what it did.
    faults: Vec<FaultFigures>,
    /// Why each failed request failed.
    failures: Vec<String>,
    /// The longest gap between two streamed tokens of one answer, s.
    longest_stall_s: f64,
    /// The longest wait from a request to its first token, s.
    longest_first_token_s: f64,
    kinds: Vec<KindFigures>,
}

/// One fault's toll.
#[derive(Debug, Serialize)]
struct FaultFigures {
    kind: Kind,
    host: usize,
    detail: String,
    /// When it began, from the first fault, s.
    at_s: f64,
    lasted_s: f64,
    /// Streams stalled across its healing.
    stalled_streams: usize,
    /// The longest of their healed → next token, s.
    heal_to_token_max_s: Option<f64>,
}

/// One kind of fault's toll.
#[derive(Debug, Serialize)]
struct KindFigures {
    kind: Kind,
    faults: usize,
    /// Faults of this kind that stalled at least one stream.
    stalled_faults: usize,
    /// Stall time (gaps over [`STALL`] between two tokens) after faults of this kind
    /// began and before the next fault, s.
    stall_total_s: f64,
    stall_max_s: f64,
    /// For streams stalled across the healing: healed → their next token, s.
    heal_to_token_p50_s: Option<f64>,
    heal_to_token_max_s: Option<f64>,
}

fn figures(requests: &[Request], reference: &[String], faults: &[Fault], duration: Duration) -> Figures {
    let mut changed = 0;
    let (mut failures, mut own_crash) = (Vec::new(), 0);
    for r in requests {
        let want = &reference[r.which];
        let same = match &r.failed {
            None => r.text == *want,
            // A failed answer is counted once, as failed; what it streamed must still
            // be the start of the right one.
            Some(e) => {
                // The API server the client talked to was killed under it, or was not
                // up again yet (connection refused): no server can answer that (the
                // client asks again). Counted apart.
                let crashed = faults.iter().any(|f| {
                    matches!(f.kind, Kind::Crash | Kind::LeaderCrash)
                        && f.host == r.host
                        && f.start <= r.ended
                        && (f.start >= r.sent || (e.contains("Connection refused") && r.sent <= f.healed + OWN_RESTART))
                });
                if crashed {
                    own_crash += 1;
                } else {
                    failures.push(format!("n{} request {}: {e}", r.host, r.which));
                }
                want.starts_with(&r.text)
            }
        };
        if !same {
            changed += 1;
            eprintln!(
                "[soak] changed answer to request {} through n{}:\n  got  {:?}\n  want {:?}",
                r.which, r.host, r.text, want
            );
        }
    }
    // Stalls, each blamed on the last fault that began before it did (a token is due
    // tens of milliseconds after the last one; [`STALL`] is the margin).
    let blame = |last: Instant| faults.iter().rev().find(|f| f.start < last + STALL).map(|f| f.kind);
    let mut stalls: BTreeMap<Kind, Vec<f64>> = BTreeMap::new();
    let (mut longest, mut first_token) = (0f64, 0f64);
    for r in requests {
        if let Some(first) = r.times.first() {
            first_token = first_token.max(first.duration_since(r.sent).as_secs_f64());
        }
        for w in r.times.windows(2) {
            let gap = w[1].duration_since(w[0]);
            longest = longest.max(gap.as_secs_f64());
            if gap > STALL {
                if let Some(k) = blame(w[0]) {
                    stalls.entry(k).or_default().push(gap.as_secs_f64());
                }
            }
        }
    }
    let t0 = faults.first().map_or_else(Instant::now, |f| f.start);
    let per_fault: Vec<FaultFigures> = faults
        .iter()
        .map(|f| {
            let heal: Vec<f64> = requests
                .iter()
                .flat_map(|r| r.times.windows(2))
                .filter(|w| w[0] < f.healed && f.healed <= w[1] && w[1].duration_since(w[0]) > STALL)
                .map(|w| w[1].duration_since(f.healed).as_secs_f64())
                .collect();
            FaultFigures {
                kind: f.kind,
                host: f.host,
                detail: f.detail.clone(),
                at_s: f.start.duration_since(t0).as_secs_f64(),
                lasted_s: f.healed.duration_since(f.start).as_secs_f64(),
                stalled_streams: heal.len(),
                heal_to_token_max_s: heal.iter().copied().reduce(f64::max),
            }
        })
        .collect();
    let mut kinds = Vec::new();
    for kind in [Kind::WifiDrop, Kind::LossBurst, Kind::Lid, Kind::Crash, Kind::LeaderCrash, Kind::Renumber] {
        let of_kind: Vec<&Fault> = faults.iter().filter(|f| f.kind == kind).collect();
        let (mut heal, mut stalled_faults) = (Vec::new(), 0);
        for f in &of_kind {
            let mut stalled = false;
            for r in requests {
                for w in r.times.windows(2) {
                    if w[0] < f.healed && f.healed <= w[1] && w[1].duration_since(w[0]) > STALL {
                        heal.push(w[1].duration_since(f.healed).as_secs_f64());
                        stalled = true;
                    }
                }
            }
            stalled_faults += stalled as usize;
        }
        let s = stalls.remove(&kind).unwrap_or_default();
        kinds.push(KindFigures {
            kind,
            faults: of_kind.len(),
            stalled_faults,
            stall_total_s: s.iter().fold(0.0, |a, b| a + b),
            stall_max_s: s.iter().copied().fold(0.0, f64::max),
            heal_to_token_max_s: heal.iter().copied().reduce(f64::max),
            heal_to_token_p50_s: (!heal.is_empty()).then(|| median(&mut heal)),
        });
    }
    Figures {
        duration_s: duration.as_secs_f64(),
        requests: requests.len(),
        tokens: requests.iter().map(|r| r.tokens).sum(),
        answers_changed: changed,
        requests_failed: failures.len(),
        ended_by_own_node_crash: own_crash,
        faults: per_fault,
        failures,
        longest_stall_s: longest,
        longest_first_token_s: first_token,
        kinds,
    }
}

fn print_table(f: &Figures, a: &SoakArgs, stages: usize) {
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    for x in &f.faults {
        eprintln!(
            "[soak] {:>7.1} s {:<12} n{} {:<28} stalled {} stream(s), healed→token max {}",
            x.at_s,
            x.kind.label(),
            x.host,
            x.detail,
            x.stalled_streams,
            opt(x.heal_to_token_max_s)
        );
    }
    println!(
        "soak: {} nodes on namespace hosts, the model in {stages} stages, a client streaming on every host, seed {}, {:.2} h",
        a.nodes,
        a.seed,
        f.duration_s / 3600.0
    );
    println!("  requests          {:>8}", f.requests);
    println!("  tokens            {:>8}", f.tokens);
    println!("  faults            {:>8}", f.kinds.iter().map(|k| k.faults).sum::<usize>());
    println!("  answers changed   {:>8}   (must be 0)", f.answers_changed);
    println!("  requests failed   {:>8}   (must be 0)", f.requests_failed);
    println!(
        "  requests whose own API node was killed under them or not up yet: {} (no server answers those; the client asks again)",
        f.ended_by_own_node_crash
    );
    for e in &f.failures {
        println!("    {e}");
    }
    println!("  longest stall     {:>8.2} s (between two streamed tokens)", f.longest_stall_s);
    println!("  longest wait for a first token {:.2} s", f.longest_first_token_s);
    println!(
        "  {:<13} {:>6} {:>8} {:>12} {:>10} {:>16} {:>10}",
        "fault", "count", "stalled", "stall total", "stall max", "healed→token p50", "max"
    );
    for k in &f.kinds {
        println!(
            "  {:<13} {:>6} {:>8} {:>10.1} s {:>8.2} s {:>14} s {:>8} s",
            k.kind.label(),
            k.faults,
            k.stalled_faults,
            k.stall_total_s,
            k.stall_max_s,
            opt(k.heal_to_token_p50_s),
            opt(k.heal_to_token_max_s)
        );
    }
    println!(
        "  (stalled: faults after which some stream waited over {} s for a token; healed→token: for those streams,",
        STALL.as_secs()
    );
    println!("   from the link up / loss gone / process continued or restarted / new address to their next token)");
}
