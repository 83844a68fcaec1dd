//! `shoal-lab bench adoption`: the cluster against a stranger, on namespace hosts (real
//! mDNS between network stacks, real QUIC). Host 0 runs a stranger's cluster, host 1 a
//! fresh node, host 2 its owner's cluster. The stranger approves the fresh node (started
//! with default flags, then `--no-create`): it must stay out. Its owner arms it to take
//! an approval from the owner's node (`shoal join --accept`), and the stranger sends it
//! a welcome into a state of its making that carries the owner's real cluster id
//! (security review F2): refused; the owner's approval then lets it in. It leaves; the
//! owner lets it in with a pairing code; it leaves; with a join token. The member
//! restarts while host 0 floods the owner's node with spoofed QUIC Initials: the time
//! until it is back is a figure. Last, host 0 takes 8 addresses and holds HTTP requests
//! to the owner's node open with bodies sent a byte at a time (review F7), while the
//! owner's machine asks its own node: how long those requests take. Also the hidden lab
//! tools that run inside host 0: `flood`, `forge-welcome`, `slow-bodies`.

use super::cluster::{Cluster, WAIT};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use shoal_membership::Liveness;
use shoal_types::{ClusterId, NodeId};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Addresses host 0 sends slow bodies from.
const SLOW_SOURCES: u8 = 8;
/// The owner node's HTTP port (on every address: the slow bodies come from the LAN).
const HTTP_PORT: u16 = 11434;

#[derive(Args, Debug)]
pub struct AdoptionArgs {
    /// Spoofed Initials sent at each of the owner node's two endpoints.
    #[arg(long, default_value_t = 10_000)]
    flood: usize,
    /// Connections each of the 8 addresses opens to the owner node's HTTP port.
    #[arg(long, default_value_t = 64)]
    slow_per_source: usize,
    /// How long the slow bodies are held, seconds (the server closes a body slower than
    /// 16 KiB/s after 30 s).
    #[arg(long, default_value_t = 45)]
    slow_seconds: u64,
    /// Print JSON instead of lines.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ForgeArgs {
    /// The victim's join endpoint.
    #[arg(long)]
    target: SocketAddr,
    /// The victim's node id.
    #[arg(long)]
    node: NodeId,
    /// The cluster id to claim (the real one: it is public).
    #[arg(long)]
    cluster: ClusterId,
}

#[derive(Args, Debug)]
pub struct SlowArgs {
    /// Where to send (an HTTP server's address).
    #[arg(long)]
    target: SocketAddr,
    /// Source addresses (repeat).
    #[arg(long, required = true)]
    from: Vec<IpAddr>,
    /// Connections per source address.
    #[arg(long, default_value_t = 64)]
    per_source: usize,
    /// How long to hold them, seconds.
    #[arg(long, default_value_t = 45)]
    seconds: u64,
}

/// What `slow-bodies` saw.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
struct Slow {
    /// Connections the server accepted (TCP).
    opened: usize,
    /// Connections that could not be opened.
    refused: usize,
    /// Accepted ones the server let go of within 2 s (over its places for one address,
    /// or for all of them).
    turned_away: usize,
    /// Accepted ones the server closed (or answered) later, before the end.
    closed_by_server: usize,
    /// Seconds from the start to the first of those later closes, if any.
    first_close_s: Option<f64>,
}

#[derive(Args, Debug)]
pub struct FloodArgs {
    /// Where to send (repeat for several endpoints).
    #[arg(long, required = true)]
    target: Vec<SocketAddr>,
    /// Initials per target.
    #[arg(long, default_value_t = 10_000)]
    count: usize,
}

/// What the bench saw.
#[derive(Debug, Serialize)]
struct Figures {
    /// The stranger's `shoal nodes approve` for the fresh node (default flags): its error.
    stranger_approve_default: String,
    /// The fresh node was in no cluster afterwards.
    default_stayed_out: bool,
    /// The same with `--no-create`.
    stranger_approve_no_create: String,
    no_create_stayed_out: bool,
    /// A stranger's welcome with the owner's real cluster id while the fresh node was
    /// armed to take its owner's approval: the answer.
    forged_welcome: String,
    /// The fresh node was in no cluster afterwards.
    forged_welcome_stayed_out: bool,
    /// Then the owner's approval let it in (and it left again).
    joined_by_approval: bool,
    /// The fresh node joined its owner's cluster with a pairing code (not the stranger's).
    joined_by_code: bool,
    /// `shoal leave`: it was unpaired after, and no longer a member at its owner's node.
    left: bool,
    /// Restarted with `--join-token`: it joined its owner's cluster by itself.
    joined_by_token: bool,
    join_token_s: f64,
    /// Spoofed Initials that left host 0 while the member restarted.
    flood_sent: usize,
    /// Restart → the member is alive at its owner's node again, during the flood.
    back_during_flood_s: f64,
    /// Host 0's slow bodies to the owner node's HTTP port, from 8 addresses.
    slow: Slow,
    /// The owner's machine asking its own node (`/health` on 127.0.0.1) meanwhile:
    /// requests, failures, median and longest time.
    loopback_requests: usize,
    loopback_failed: usize,
    loopback_p50_ms: f64,
    loopback_max_ms: f64,
    /// The median time of the same requests before the slow bodies.
    loopback_before_p50_ms: f64,
}

fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> Result<(T, Duration)> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok((v, t0.elapsed()));
        }
        if t0.elapsed() > limit {
            bail!("{what}: not within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn cluster_of(c: &Cluster, k: usize) -> Option<Option<ClusterId>> {
    c.status(k).map(|s| s.cluster)
}

/// The stranger (node 0) approves node 1: the error it got (it must get one).
fn stranger_approves(c: &Cluster, fresh: NodeId) -> Result<String> {
    poll("the stranger lists the fresh node as pending", WAIT, || {
        c.status(0).filter(|s| s.pending.iter().any(|p| p.node == fresh))
    })?;
    match c.cli(0, &["nodes", "approve", &fresh.to_string()[..16]]) {
        Ok(out) => Ok(format!("approved: {out}")),
        Err(e) => Ok(e.to_string()),
    }
}

/// Node 1 stays out of every cluster for a few seconds.
fn stays_out(c: &Cluster) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        if cluster_of(c, 1).is_none_or(|cl| cl.is_some()) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    true
}

pub fn adoption(a: AdoptionArgs) -> Result<()> {
    let mut c = Cluster::new("ad", 3)?;
    let fresh = c.id(1)?;

    // A stranger's cluster on the LAN, and a fresh node with default flags.
    c.start(0, &["--create-cluster"])?;
    poll("the stranger's cluster", WAIT, || cluster_of(&c, 0).flatten())?;
    c.start(1, &[])?;
    let stranger_approve_default = stranger_approves(&c, fresh)?;
    let default_stayed_out = stays_out(&c);
    c.kill(1, false)?;
    c.start(1, &["--no-create"])?;
    poll("the fresh node answers", WAIT, || c.status(1))?;
    let stranger_approve_no_create = stranger_approves(&c, fresh)?;
    let no_create_stayed_out = stays_out(&c);
    eprintln!("[bench] the stranger's approvals: {stranger_approve_default} / {stranger_approve_no_create}");

    // The owner's cluster (its API on every address: the slow bodies come from the LAN).
    let http = format!("0.0.0.0:{HTTP_PORT}");
    c.start(2, &["--create-cluster", "--http-listen", &http])?;
    let (owner, _) = poll("the owner's cluster", WAIT, || cluster_of(&c, 2).flatten())?;
    let owner_node = c.id(2)?.to_string();

    // Armed for the owner's approval, the fresh node gets the stranger's welcome first.
    poll("the fresh node takes an approval from the owner's node", WAIT, || {
        c.cli(1, &["join", "--accept", &owner_node[..16]]).ok()
    })?;
    let forged = c
        .net()
        .command(0, std::env::current_exe().context("locating shoal-lab")?)
        .args(["bench", "forge-welcome", "--node", &fresh.to_string(), "--cluster", &owner.to_string()])
        .args(["--target", &SocketAddr::from((c.net().addr(1), 47071)).to_string()])
        .output()
        .context("sending the forged welcome")?;
    let forged_welcome = String::from_utf8_lossy(&forged.stdout).trim().to_string();
    let forged_welcome_stayed_out = stays_out(&c);
    eprintln!("[bench] the stranger's welcome: {forged_welcome}");
    poll("the owner lists the fresh node as pending", WAIT, || {
        c.status(2).filter(|s| s.pending.iter().any(|p| p.node == fresh))
    })?;
    c.cli(2, &["nodes", "approve", &fresh.to_string()[..16]])?;
    let joined_by_approval =
        poll("the fresh node in its owner's cluster", WAIT, || (cluster_of(&c, 1) == Some(Some(owner))).then_some(()))
            .is_ok();
    poll("the owner sees the approved member alive", WAIT, || {
        c.status(2).filter(|s| s.members.iter().any(|m| m.node == fresh && m.state == Liveness::Alive))
    })?;
    c.cli(1, &["leave"])?;
    poll("the owner drops the member", WAIT, || c.status(2).filter(|s| s.members.iter().all(|m| m.node != fresh)))?;

    // A code, then (after leaving) a token.
    let code = c.cli(2, &["nodes", "pair"])?;
    poll("the fresh node joins with the code", WAIT, || c.cli(1, &["join", &code]).ok())?;
    let joined_by_code = cluster_of(&c, 1) == Some(Some(owner));
    poll("the owner sees the new member alive", WAIT, || {
        c.status(2).filter(|s| s.members.iter().any(|m| m.node == fresh && m.state == Liveness::Alive))
    })?;
    c.cli(1, &["leave"])?;
    let left = cluster_of(&c, 1) == Some(None)
        && poll("the owner drops the member", WAIT, || {
            c.status(2).filter(|s| s.members.iter().all(|m| m.node != fresh))
        })
        .is_ok();
    let token = c.cli(2, &["nodes", "token", "--valid", "10m"])?;
    c.kill(1, false)?;
    c.start(1, &["--no-create", "--join-token", &token])?;
    let joined = poll("the fresh node joins with the token", WAIT, || {
        c.status(2).filter(|s| s.members.iter().any(|m| m.node == fresh && m.state == Liveness::Alive))
    });
    let (joined_by_token, join_token_s) = match joined {
        Ok((_, t)) => (cluster_of(&c, 1) == Some(Some(owner)), t.as_secs_f64()),
        Err(e) => {
            eprintln!("[bench] {e}");
            (false, 0.0)
        }
    };

    // The member restarts while host 0 floods the owner's node: once the owner has
    // seen it go (else "back" would be the owner not having noticed yet).
    c.kill(1, false)?;
    poll("the owner sees the member gone", WAIT, || {
        c.status(2).filter(|s| s.members.iter().any(|m| m.node == fresh && m.state != Liveness::Alive))
    })?;
    let owner_ip = c.net().addr(2);
    let targets = [SocketAddr::from((owner_ip, 47070)), SocketAddr::from((owner_ip, 47071))];
    let flooder = c
        .net()
        // The flood tool is this program's (`shoal-lab bench flood`), not `shoal`'s.
        .command(0, std::env::current_exe().context("locating shoal-lab")?)
        .args(["bench", "flood", "--count", &a.flood.to_string()])
        .args(targets.iter().flat_map(|t| ["--target".to_string(), t.to_string()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the flood")?;
    std::thread::sleep(Duration::from_millis(300));
    c.start(1, &["--no-create"])?;
    let back = poll("the member is back during the flood", WAIT, || {
        c.status(2).filter(|s| s.members.iter().any(|m| m.node == fresh && m.state == Liveness::Alive))
    });
    let out = flooder.wait_with_output()?;
    let flood_sent: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
    let back_during_flood_s = match back {
        Ok((_, t)) => t.as_secs_f64(),
        Err(e) => bail!("{e} (flood of {flood_sent} Initials)"),
    };

    // Slow bodies from 8 addresses of host 0 while the owner's machine asks its node
    // (and, to compare, before).
    let before = c.net().within(2, || loopback_times(Duration::from_secs(3)))??;
    let before: Vec<f64> = before.iter().filter_map(|t| *t).collect();
    let sources = extra_addresses(&c, 0, SLOW_SOURCES)?;
    let target = SocketAddr::from((owner_ip, HTTP_PORT));
    let slow_tool = c
        .net()
        .command(0, std::env::current_exe().context("locating shoal-lab")?)
        .args(["bench", "slow-bodies", "--target", &target.to_string()])
        .args(["--per-source", &a.slow_per_source.to_string(), "--seconds", &a.slow_seconds.to_string()])
        .args(sources.iter().flat_map(|ip| ["--from".to_string(), ip.to_string()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the slow bodies")?;
    // Once they hold their places; then until a little after the server's 30 s.
    std::thread::sleep(Duration::from_secs(3));
    let window = Duration::from_secs(a.slow_seconds.saturating_sub(5).max(5));
    let times = c.net().within(2, move || loopback_times(window))??;
    let out = slow_tool.wait_with_output()?;
    let slow: Slow = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("the slow-bodies tool said {:?}", String::from_utf8_lossy(&out.stdout)))?;
    let answered: Vec<f64> = times.iter().filter_map(|t| *t).collect();
    let (loopback_p50_ms, loopback_max_ms) = (percentile(&answered, 0.5), percentile(&answered, 1.0));

    let f = Figures {
        forged_welcome,
        forged_welcome_stayed_out,
        joined_by_approval,
        slow,
        loopback_requests: times.len(),
        loopback_failed: times.len() - answered.len(),
        loopback_p50_ms,
        loopback_max_ms,
        loopback_before_p50_ms: percentile(&before, 0.5),
        stranger_approve_default,
        default_stayed_out,
        stranger_approve_no_create,
        no_create_stayed_out,
        joined_by_code,
        left,
        joined_by_token,
        join_token_s,
        flood_sent,
        back_during_flood_s,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        println!("a stranger's approval (default flags): stayed out = {}", f.default_stayed_out);
        println!("a stranger's approval (--no-create):   stayed out = {}", f.no_create_stayed_out);
        println!(
            "a stranger's welcome with the real cluster id (node armed for its owner): stayed out = {} ({})",
            f.forged_welcome_stayed_out, f.forged_welcome
        );
        println!("owner's approval: joined = {}", f.joined_by_approval);
        println!("owner's code: joined = {}; leave: done = {}", f.joined_by_code, f.left);
        println!("owner's token: joined = {} in {:.2} s", f.joined_by_token, f.join_token_s);
        println!(
            "member restart during a flood of {} spoofed Initials: back in {:.2} s",
            f.flood_sent, f.back_during_flood_s
        );
        println!(
            "slow bodies from {} addresses: {} connected, {} turned away at once, {} refused, {} closed by the node later (first after {})",
            SLOW_SOURCES,
            f.slow.opened,
            f.slow.turned_away,
            f.slow.refused,
            f.slow.closed_by_server,
            f.slow.first_close_s.map_or("-".into(), |s| format!("{s:.1} s"))
        );
        println!(
            "this machine's own requests meanwhile: {} answered of {}, median {:.1} ms (before: {:.1} ms), longest {:.1} ms",
            f.loopback_requests - f.loopback_failed,
            f.loopback_requests,
            f.loopback_p50_ms,
            f.loopback_before_p50_ms,
            f.loopback_max_ms
        );
    }
    Ok(())
}

/// Give host `k` `n - 1` more addresses on its /24 (it has one): 180, 181, … Its
/// addresses, the first one first.
fn extra_addresses(c: &Cluster, k: usize, n: u8) -> Result<Vec<Ipv4Addr>> {
    let first = c.net().addr(k);
    let mut out = vec![first];
    for i in 1..n {
        let [a, b, cc, _] = first.octets();
        let ip = Ipv4Addr::new(a, b, cc, 180 + i);
        let ok = std::process::Command::new("ip")
            .args(["-n", c.net().namespace(k), "addr", "add", &format!("{ip}/24"), "dev", &format!("v{k}")])
            .status()?
            .success();
        if !ok {
            bail!("cannot add {ip} to host {k}");
        }
        out.push(ip);
    }
    Ok(out)
}

/// GET `/api/version` (answered with or without a model) on this host's node
/// (127.0.0.1) every 250 ms for `window`: each request's time in ms, `None` where it
/// failed (5 s at most).
fn loopback_times(window: Duration) -> Result<Vec<Option<f64>>> {
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(5))).build().into();
    let url = format!("http://127.0.0.1:{HTTP_PORT}/api/version");
    let mut out = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < window {
        let t = Instant::now();
        let ok = agent.get(&url).call().is_ok_and(|r| r.status() == 200);
        out.push(ok.then(|| t.elapsed().as_secs_f64() * 1e3));
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(out)
}

/// The `q` quantile of `v` (0: none).
fn percentile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n => v[((n - 1) as f64 * q).round() as usize],
    }
}

/// `shoal-lab bench forge-welcome`: a fresh key sends the victim a welcome into a state
/// it made (itself and the victim as members, the claimed cluster id); print the answer.
pub fn forge_welcome(a: ForgeArgs) -> Result<()> {
    use shoal_membership::wire::{read_msg, write_msg, JoinRequest, JoinResponse};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let stranger = std::sync::Arc::new(shoal_net::Identity::generate()?);
        let member = |id: NodeId| shoal_membership::Member {
            id,
            name: "hub".into(),
            role: shoal_types::Role::Hub,
            memory_bytes: 1 << 40,
        };
        let mut forged = shoal_membership::ClusterState::create(a.cluster, member(stranger.id()));
        forged.apply(&shoal_membership::Change::AddMember(member(a.node)))?;
        forged.version = shoal_membership::Version { term: 1, index: 2 };
        let from = SocketAddr::from(([0, 0, 0, 0], 0));
        let open = shoal_net::Node::bind_open(from, stranger, &shoal_net::TransportOptions::default())?;
        let conn = open.connect(a.target, a.node, shoal_net::alpn::JOIN).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        write_msg(&mut send, &JoinRequest::Welcome { state: Box::new(forged) }).await?;
        let answer: Option<JoinResponse> = read_msg(&mut recv).await?;
        match answer {
            Some(JoinResponse::Error(e)) => println!("refused: {e}"),
            other => println!("taken: {other:?}"),
        }
        conn.close(0u32.into(), b"done");
        anyhow::Ok(())
    })
}

/// `shoal-lab bench slow-bodies`: `per_source` connections from each address, each a
/// POST to the admin login announcing a 60,000-byte body and sending one byte of it
/// every 10 s; print [`Slow`] as JSON.
pub fn slow_bodies(a: SlowArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let t0 = tokio::time::Instant::now();
        let end = t0 + Duration::from_secs(a.seconds);
        let mut tasks = tokio::task::JoinSet::new();
        for ip in &a.from {
            for _ in 0..a.per_source {
                tasks.spawn(hold_slow_body(*ip, a.target, t0, end));
            }
        }
        let mut out = Slow::default();
        while let Some(r) = tasks.join_next().await {
            match r {
                Ok(Some(closed)) => {
                    out.opened += 1;
                    match closed.map(|t| t.as_secs_f64()) {
                        Some(t) if t < 2.0 => out.turned_away += 1,
                        Some(t) => {
                            out.closed_by_server += 1;
                            out.first_close_s = Some(out.first_close_s.map_or(t, |f: f64| f.min(t)));
                        }
                        None => {}
                    }
                }
                _ => out.refused += 1,
            }
        }
        println!("{}", serde_json::to_string(&out)?);
        anyhow::Ok(())
    })
}

/// One slow body from `ip` to `target` until `end`: `None` if it could not connect;
/// else when the server let go of it (since `t0`), `None` if it held to the end.
async fn hold_slow_body(
    ip: IpAddr,
    target: SocketAddr,
    t0: tokio::time::Instant,
    end: tokio::time::Instant,
) -> Option<Option<Duration>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = if ip.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }.ok()?;
    socket.bind(SocketAddr::new(ip, 0)).ok()?;
    let stream = tokio::time::timeout(Duration::from_secs(5), socket.connect(target)).await.ok()?.ok()?;
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST /admin/api/login HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\nContent-Length: 60000\r\n\r\n{{"
    );
    if wr.write_all(head.as_bytes()).await.is_err() {
        return Some(Some(t0.elapsed()));
    }
    let mut buf = [0u8; 512];
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(end) => return Some(None),
            _ = tokio::time::sleep(Duration::from_secs(10)) => {
                if wr.write_all(b" ").await.is_err() {
                    return Some(Some(t0.elapsed()));
                }
            }
            // An answer or a close: either way the server let go.
            _ = rd.read(&mut buf) => return Some(Some(t0.elapsed())),
        }
    }
}

/// `shoal-lab bench flood`: print how many Initials left.
pub fn flood(a: FloodArgs) -> Result<()> {
    let from = SocketAddr::from(([0, 0, 0, 0], 0));
    let sent = shoal_testnet::flood::send_initials(from, &a.target, a.count, shoal_net::alpn::MEMBERSHIP, |_| {})?;
    println!("{sent}");
    Ok(())
}
