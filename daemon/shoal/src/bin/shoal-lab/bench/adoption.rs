//! `shoal-lab bench adoption`: the cluster against a stranger, on namespace hosts (real
//! mDNS between network stacks, real QUIC). Host 0 runs a stranger's cluster, host 1 a
//! fresh node, host 2 its owner's cluster. The stranger approves the fresh node (started
//! with default flags, then `--no-create`): it must stay out. The owner lets it in with a
//! pairing code; it leaves; the owner lets it in again with a join token. Last, the
//! member restarts while host 0 floods the owner's node with spoofed QUIC Initials: the
//! time until it is back is the figure. Also `shoal-lab bench flood`, the hidden tool that
//! sends the flood from inside a namespace.

use super::cluster::{Cluster, WAIT};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use shoal_membership::Liveness;
use shoal_types::{ClusterId, NodeId};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct AdoptionArgs {
    /// Spoofed Initials sent at each of the owner node's two endpoints.
    #[arg(long, default_value_t = 10_000)]
    flood: usize,
    /// Print JSON instead of lines.
    #[arg(long)]
    json: bool,
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

    // The owner's cluster: a code, then (after leaving) a token.
    c.start(2, &["--create-cluster"])?;
    let (owner, _) = poll("the owner's cluster", WAIT, || cluster_of(&c, 2).flatten())?;
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

    // The member restarts while host 0 floods the owner's node.
    c.kill(1, false)?;
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

    let f = Figures {
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
        println!("owner's code: joined = {}; leave: done = {}", f.joined_by_code, f.left);
        println!("owner's token: joined = {} in {:.2} s", f.joined_by_token, f.join_token_s);
        println!(
            "member restart during a flood of {} spoofed Initials: back in {:.2} s",
            f.flood_sent, f.back_during_flood_s
        );
    }
    Ok(())
}

/// `shoal-lab bench flood`: print how many Initials left.
pub fn flood(a: FloodArgs) -> Result<()> {
    let from = SocketAddr::from(([0, 0, 0, 0], 0));
    let sent = shoal_testnet::flood::send_initials(from, &a.target, a.count, shoal_net::alpn::MEMBERSHIP, |_| {})?;
    println!("{sent}");
    Ok(())
}
